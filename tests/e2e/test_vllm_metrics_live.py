"""A live node's `/metrics` after a few requests: every vLLM metric an operator's tools read is there, under vLLM's
name and labels, with a value these requests explain (counts equal to the requests sent, histograms with as many
observations, token totals equal to what the answers say)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hybridpd.engine.model.presets import write_checkpoint
from tests.e2e.nodes import assert_blocks_free, start_node

REQUESTS = 5
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    model = write_checkpoint("tiny", tmp_path_factory.mktemp("m") / "tiny")
    node = start_node(model, tmp_path_factory.mktemp("logs"), ["--num-blocks", "256", "--max-model-len", "512"])
    try:
        prompt_tokens = 0
        for i in range(REQUESTS):
            status, body = node.post_json("/v1/completions", {"prompt": [7, 8, 9, 10 + i] * (i + 1),
                                                              "max_tokens": MAX_TOKENS, "ignore_eos": True})
            assert status == 200, body
            prompt_tokens += body["usage"]["prompt_tokens"]
        assert_blocks_free(node)
        samples = {}
        for family in text_string_to_metric_families(node.metrics()):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append(sample)
        yield samples, prompt_tokens
    finally:
        node.kill()


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
    ("vllm:num_requests_waiting", 0),
])
def test_a_live_node_exports_vllm_metrics_that_count_its_requests(scraped, name, expected):
    samples, _ = scraped
    assert total(samples, name) == expected


def test_token_totals_and_cache_figures_are_plausible(scraped):
    samples, prompt_tokens = scraped
    assert total(samples, "vllm:prompt_tokens_total") == prompt_tokens
    assert total(samples, "vllm:prefix_cache_queries_total") == prompt_tokens
    assert 0 <= total(samples, "vllm:prefix_cache_hits_total") <= prompt_tokens
    assert 0 <= total(samples, "vllm:kv_cache_usage_perc") <= 1
    assert total(samples, "vllm:nixl_num_failed_transfers_total") == 0   # no pull was made
    reasons = {s.labels["finished_reason"]: s.value for s in samples["vllm:request_success_total"]}
    assert reasons == {"length": REQUESTS}
