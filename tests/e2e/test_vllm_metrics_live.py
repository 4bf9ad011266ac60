"""A live node's `/metrics` after a few requests: every vLLM metric an operator's tools read is there, under vLLM's
name and labels, with a value these requests explain (counts equal to the requests sent, histograms with as many
observations, token totals equal to what the answers say). And the P/D dashboard (deploy/k8s/overlays/monitoring):
it has the fields Grafana's dashboard model requires, and every query names a metric a live node or proxy exports."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hybridpd.presets.checkpoints import write_checkpoint
from tests.e2e.faults import start_proxy
from tests.e2e.nodes import assert_blocks_free, start_node

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "overlays" / "monitoring" / "hybridpd-pd.json"

REQUESTS = 5
MAX_TOKENS = 4


def families(text: str) -> dict:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
        out.setdefault(family.name, [])
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One node with a storage tier, and a proxy in front of it in both roles (their metric families are what the
    dashboard reads)."""
    model = write_checkpoint("tiny", tmp_path_factory.mktemp("m") / "tiny")
    logs = tmp_path_factory.mktemp("logs")
    offload = tmp_path_factory.mktemp("kv-offload")
    node = start_node(model, logs, ["--num-blocks", "256", "--max-model-len", "512", "--kv-offload-dir", str(offload),
                                    "--kv-offload-size", "64MiB", "--kv-cache-metrics", "--kv-cache-metrics-sample",
                                    "1"])
    proxy = None
    try:
        proxy = start_proxy(node, node, logs)
        yield node, proxy
    finally:
        if proxy is not None:
            proxy.kill()
        node.kill()


@pytest.fixture(scope="module")
def scraped(cluster):
    node, _ = cluster
    prompt_tokens = 0
    for i in range(REQUESTS):
        status, body = node.post_json("/v1/completions", {"prompt": [7, 8, 9, 10 + i] * (i + 1),
                                                          "max_tokens": MAX_TOKENS, "ignore_eos": True})
        assert status == 200, body
        prompt_tokens += body["usage"]["prompt_tokens"]
    assert_blocks_free(node)
    return families(node.metrics()), prompt_tokens


def total(samples, name: str) -> float:
    assert name in samples, f"{name} is not exported"
    for sample in samples[name]:
        assert sample.labels.get("model_name") == "tiny" and sample.labels.get("engine") == "0", sample
    return sum(sample.value for sample in samples[name])


@pytest.mark.parametrize("name, expected", [
    ("vllm:request_success_total", REQUESTS),
    ("vllm:time_to_first_token_seconds_count", REQUESTS),
    ("vllm:e2e_request_latency_seconds_count", REQUESTS),
    ("vllm:inter_token_latency_seconds_count", REQUESTS * (MAX_TOKENS - 1)),
    ("vllm:generation_tokens_total", REQUESTS * MAX_TOKENS),
    ("vllm:request_generation_tokens_count", REQUESTS),
    ("vllm:request_prompt_tokens_count", REQUESTS),
    ("vllm:num_requests_running", 0),
    ("vllm:request_queue_time_seconds_count", REQUESTS),
    ("vllm:request_prefill_time_seconds_count", REQUESTS),
    ("vllm:request_decode_time_seconds_count", REQUESTS),
    ("vllm:request_inference_time_seconds_count", REQUESTS),
    ("vllm:request_time_per_output_token_seconds_count", REQUESTS),
    ("vllm:request_params_max_tokens_sum", REQUESTS * MAX_TOKENS),
    ("vllm:request_params_n_sum", REQUESTS),
    ("vllm:request_max_num_generation_tokens_sum", REQUESTS * MAX_TOKENS),
    ("vllm:request_num_preemptions_count", REQUESTS),
    ("vllm:num_preemptions_total", 0),
    ("vllm:num_requests_waiting", 0),
    ("vllm:num_requests_waiting_by_reason", 0),
    ("vllm:num_requests_kv_fetch_by_stage", 0),
])
def test_a_live_node_exports_vllm_metrics_that_count_its_requests(scraped, name, expected):
    samples, _ = scraped
    assert total(samples, name) == expected


def test_the_cache_config_info_states_the_nodes_block_size_and_capacity(scraped):
    """`vllm:cache_config_info` as the start-up report states the cache (--num-blocks 256: 255 usable blocks)."""
    samples, _ = scraped
    (sample,) = samples["vllm:cache_config_info"]
    assert sample.value == 1 and sample.labels["engine"] == "0"
    assert (sample.labels["block_size"], sample.labels["num_gpu_blocks"], sample.labels["kv_cache_size_tokens"],
            sample.labels["kv_offloading_size"]) == ("16", "255", str(255 * 16), str(64 / 1024))


def test_with_kv_cache_metrics_a_reused_block_reports_its_residency(scraped):
    """Every block followed (`--kv-cache-metrics-sample 1`): a later request's blocks reuse the memory of an earlier
    one's unhashed last block, each such end observed once in both histograms, its idle time within its lifetime."""
    samples, _ = scraped
    ended = total(samples, "vllm:kv_block_lifetime_seconds_count")
    assert ended >= 1 and total(samples, "vllm:kv_block_idle_before_evict_seconds_count") == ended
    assert 0 <= total(samples, "vllm:kv_block_idle_before_evict_seconds_sum") <= total(
        samples, "vllm:kv_block_lifetime_seconds_sum")


def test_token_totals_and_cache_figures_are_plausible(scraped):
    samples, prompt_tokens = scraped
    assert total(samples, "vllm:prompt_tokens_total") == prompt_tokens
    assert total(samples, "vllm:prefix_cache_queries_total") == prompt_tokens
    assert 0 <= total(samples, "vllm:prefix_cache_hits_total") <= prompt_tokens
    # where the prompts' tokens came from (a node with a storage tier queries it for what memory lacked)
    local = total(samples, "vllm:prefix_cache_hits_total")
    external = total(samples, "vllm:external_prefix_cache_hits_total")
    assert total(samples, "vllm:external_prefix_cache_queries_total") == prompt_tokens - local
    assert total(samples, "vllm:prompt_tokens_cached_by_source_total") == local + external
    assert total(samples, "vllm:prompt_tokens_cached_total") == local + external
    assert total(samples, "vllm:prompt_tokens_by_source_total") == prompt_tokens
    computed = sum(sample.value for sample in samples["vllm:prompt_tokens_by_source_total"]
                   if sample.labels["source"] == "local_compute")
    assert total(samples, "vllm:request_prefill_kv_computed_tokens_sum") == prompt_tokens - local - external
    # every step's prompt tokens computed and tokens generated, as vLLM counts them
    assert total(samples, "vllm:iteration_tokens_total_sum") == computed + REQUESTS * MAX_TOKENS
    assert 0 <= total(samples, "vllm:kv_cache_usage_perc") <= 1
    assert total(samples, "vllm:nixl_num_failed_transfers_total") == 0   # no pull was made
    reasons = {s.labels["finished_reason"]: s.value for s in samples["vllm:request_success_total"]}
    assert reasons == {"length": REQUESTS, "stop": 0, "abort": 0, "error": 0, "repetition": 0}   # vLLM's, at 0 first


def test_the_dashboard_has_grafanas_fields_and_queries_only_exported_metrics(cluster, scraped):
    node, proxy = cluster
    with urllib.request.urlopen(proxy.url + "/metrics", timeout=10) as resp:
        exported = {**families(resp.read().decode()), **families(node.metrics())}
    dashboard = json.loads(DASHBOARD.read_text())
    assert {"uid", "title", "panels", "schemaVersion", "time", "templating"} <= dashboard.keys()
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(set(ids)) == len(ids) and dashboard["panels"]
    for panel in dashboard["panels"]:
        assert {"type", "title", "gridPos", "targets", "datasource"} <= panel.keys(), panel.get("title")
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys()
        for target in panel["targets"]:
            names = re.findall(r"\b(?:vllm:|hybridpd:|hybridpd_proxy_)[a-zA-Z0-9_:]+", target["expr"])
            assert names, target["expr"]
            for name in names:
                family = re.sub(r"_(bucket|sum|count|total)$", "", name)
                assert name in exported or family in exported, \
                    f"panel {panel['title']!r} queries {name}, which nothing exports"
