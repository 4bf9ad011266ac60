"""Our nodes' vLLM metrics against vLLM's own definitions (vllm/v1/metrics/loggers.py and the NIXL connector's
metrics, as vLLM 0.11-0.33 define them: name, type, buckets; the prompt-source counters and their `source` labels
as vLLM 0.32 does), written down here so that a rename on our side fails a test. Collected from every family a
node registers: the front's (server/metrics.py), the engine's (engine/metrics.py) and the connector's
(connector/metrics.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from hybridpd.config import CacheConfig
from hybridpd.connector.metrics import ConnectorMetrics
from hybridpd.engine.cache_info import cache_config_info
from hybridpd.engine.engine import EngineStats
from hybridpd.engine.kv_cache.capacity import KVCapacity
from hybridpd.engine.kv_cache.residency import BlockResidency
from hybridpd.engine.kv_offload.tier import TierCounters
from hybridpd.engine.metrics import EngineCollector
from hybridpd.server.metrics import ServerMetrics

MAX_MODEL_LEN = 512
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500]   # vLLM's build_1_2_5_buckets(max_model_len)
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
RESIDENCY_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200,
                     1800]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]
VLLM = [  # (name, type, buckets or None)
    ("vllm:num_requests_running", "gauge", None),
    ("vllm:num_requests_waiting", "gauge", None),
    ("vllm:num_requests_waiting_by_reason", "gauge", None),
    ("vllm:num_requests_kv_fetch_by_stage", "gauge", None),
    ("vllm:kv_cache_usage_perc", "gauge", None),
    ("vllm:prefix_cache_queries", "counter", None),
    ("vllm:prefix_cache_hits", "counter", None),
    ("vllm:external_prefix_cache_queries", "counter", None),
    ("vllm:external_prefix_cache_hits", "counter", None),
    ("vllm:prompt_tokens_cached", "counter", None),
    ("vllm:prompt_tokens_cached_by_source", "counter", None),
    ("vllm:prompt_tokens_by_source", "counter", None),
    ("vllm:prompt_tokens", "counter", None),
    ("vllm:generation_tokens", "counter", None),
    ("vllm:request_success", "counter", None),
    ("vllm:request_prompt_tokens", "histogram", TOKEN_BUCKETS),
    ("vllm:request_generation_tokens", "histogram", TOKEN_BUCKETS),
    ("vllm:time_to_first_token_seconds", "histogram",
     [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
      160.0, 640.0, 2560.0]),
    ("vllm:inter_token_latency_seconds", "histogram", ITL_BUCKETS),
    ("vllm:e2e_request_latency_seconds", "histogram", LATENCY_BUCKETS),
    *((name, "histogram", LATENCY_BUCKETS) for name in (
        "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds")),
    ("vllm:request_time_per_output_token_seconds", "histogram", ITL_BUCKETS),
    *((name, "histogram", TOKEN_BUCKETS) for name in (
        "vllm:request_params_max_tokens", "vllm:request_max_num_generation_tokens",
        "vllm:request_prefill_kv_computed_tokens")),
    ("vllm:request_params_n", "histogram", [1, 2, 5, 10, 20]),
    ("vllm:request_num_preemptions", "histogram", [1, 2, 3, 4, 5, 10, 20]),
    ("vllm:num_preemptions", "counter", None),
    ("vllm:iteration_tokens_total", "histogram", [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]),
    *((name, "histogram", RESIDENCY_BUCKETS) for name in (
        "vllm:kv_block_lifetime_seconds", "vllm:kv_block_idle_before_evict_seconds",
        "vllm:kv_block_reuse_gap_seconds")),
    ("vllm:nixl_xfer_time_seconds", "histogram",
     [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]),
    ("vllm:nixl_bytes_transferred", "histogram", [2 ** (10 + i) for i in range(1, 25, 2)]),
    ("vllm:nixl_num_failed_transfers", "counter", None),
    ("vllm:nixl_num_kv_expired_reqs", "counter", None),
]
LABELS = {"model_name": "m", "engine": "0"}


@pytest.fixture(scope="module")
def families():
    registry = CollectorRegistry()
    server = ServerMetrics(registry, "m", MAX_MODEL_LEN)
    server.request_success("length").inc()
    ConnectorMetrics(registry, "m")
    stats = EngineStats(num_running=1, num_waiting=2, num_loading=0, kv_usage=0.5, offload=TierCounters(),
                        residency=BlockResidency(0.5).snapshot())   # --kv-cache-metrics
    EngineCollector(SimpleNamespace(stats=stats), "m").register(registry)
    return {family.name: family for family in registry.collect()}


@pytest.mark.parametrize("name, kind, buckets", VLLM, ids=[row[0] for row in VLLM])
def test_a_vllm_metric_has_vllms_name_type_labels_and_buckets(families, name, kind, buckets):
    family = families.get(name)
    assert family is not None, f"{name} is not exported"
    assert family.type == kind
    for sample in family.samples:
        assert {k: sample.labels[k] for k in LABELS} == LABELS, sample
    if buckets is not None:
        bounds = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
        assert bounds == [*map(float, buckets), float("inf")]


@pytest.mark.parametrize("name, sources", [
    ("vllm:prompt_tokens_cached_by_source", {"device", "host", "p2p", "disk", "external_unspecified"}),
    ("vllm:prompt_tokens_by_source", {"local_compute", "local_cache_hit", "external_kv_transfer"}),
    ("vllm:num_requests_waiting_by_reason", {"capacity", "deferred"}),
    ("vllm:num_requests_kv_fetch_by_stage", {"waiting_to_start", "in_progress", "completed_waiting"}),
])
def test_a_family_by_source_reason_or_stage_has_every_label_vllm_gives_it(families, name, sources):
    label = next(k for k in families[name].samples[0].labels if k not in LABELS)
    assert {sample.labels[label] for sample in families[name].samples} == sources


def test_no_figure_vllm_names_is_also_exported_under_our_prefix(families):
    ours = {name.removeprefix("hybridpd:") for name in families if name.startswith("hybridpd:")}
    theirs = {name.removeprefix("vllm:") for name, _, _ in VLLM}
    assert not ours & theirs, ours & theirs


def test_requests_whose_kv_is_on_its_way_wait_as_in_vllm():
    """vLLM keeps a request whose KV it loads in its waiting queue: waiting counts them, as 'deferred'."""
    registry = CollectorRegistry()
    stats = EngineStats(num_waiting=3, num_remote_waiting=1, num_loading=2, num_loaded=1)
    EngineCollector(SimpleNamespace(stats=stats), "m").register(registry)

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, {**LABELS, **labels})
    assert value("vllm:num_requests_waiting") == 6
    assert (value("vllm:num_requests_waiting_by_reason", reason="capacity"),
            value("vllm:num_requests_waiting_by_reason", reason="deferred")) == (3, 3)
    assert [value("vllm:num_requests_kv_fetch_by_stage", stage=stage)
            for stage in ("waiting_to_start", "in_progress", "completed_waiting")] == [1, 2, 1]


def test_the_cache_config_info_is_a_gauge_at_one_labelled_as_vllm_labels_it():
    """vLLM's `vllm:cache_config_info`: its cache configuration as labels (those with a meaning here, vLLM's names
    and writing) and `engine`, no `model_name`; what the Gateway API inference extension reads for the block size
    and the capacity."""
    capacity = KVCapacity(size_tokens=4096, max_concurrency=3, memory_bytes=1 << 20)
    info = cache_config_info(CacheConfig(block_size=16), capacity, 64)
    registry = CollectorRegistry()
    EngineCollector(SimpleNamespace(stats=EngineStats(cache_info=info)), "m").register(registry)
    (sample,) = {family.name: family for family in registry.collect()}["vllm:cache_config_info"].samples
    assert sample.value == 1 and "model_name" not in sample.labels
    assert {k: sample.labels[k] for k in ("engine", "block_size", "num_gpu_blocks", "kv_cache_size_tokens",
                                          "kv_cache_max_concurrency", "enable_prefix_caching", "mamba_block_size",
                                          "kv_offloading_size", "cache_dtype")} == {
        "engine": "0", "block_size": "16", "num_gpu_blocks": "256", "kv_cache_size_tokens": "4096",
        "kv_cache_max_concurrency": "3.0", "enable_prefix_caching": "True", "mamba_block_size": "64",
        "kv_offloading_size": "None", "cache_dtype": "auto"}
