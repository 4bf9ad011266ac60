"""vLLM's metric names, labels and histogram buckets, as every node exports them so that the tools vLLM and llm-d
operators already run read our nodes unchanged (llm-d's scheduler reads the queue and cache gauges; vLLM's Grafana
dashboards the latency histograms; the P/D views the NIXL connector's figures).

Where vLLM has a figure, a node exports it under vLLM's name only (one series per figure, vLLM's types and buckets,
labels `model_name` and `engine`); what vLLM has no name for keeps ours (`hybridpd:*`): per-group-kind prefix-cache
hits, blocks per group, leases, decode-side hits of pulled prompts, the storage tier's writes and reads. Our connector
figures per pull (`hybridpd:kv_bytes_read`, `hybridpd:kv_read_seconds`) stay beside `vllm:nixl_*` because they
count a request's whole pull (every group, the lease's heartbeat included), not one NIXL transfer.
"""

from __future__ import annotations

ENGINE_INDEX = "0"   # one engine per node
LABELS = ("model_name", "engine")

NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
NUM_REQUESTS_WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
NUM_REQUESTS_KV_FETCH_BY_STAGE = "vllm:num_requests_kv_fetch_by_stage"
KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
EXTERNAL_PREFIX_CACHE_QUERIES = "vllm:external_prefix_cache_queries"
EXTERNAL_PREFIX_CACHE_HITS = "vllm:external_prefix_cache_hits"
PROMPT_TOKENS_CACHED = "vllm:prompt_tokens_cached"
PROMPT_TOKENS_CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source"
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source"
NUM_PREEMPTIONS = "vllm:num_preemptions"
ITERATION_TOKENS = "vllm:iteration_tokens_total"
REQUEST_QUEUE_TIME = "vllm:request_queue_time_seconds"
REQUEST_PREFILL_TIME = "vllm:request_prefill_time_seconds"
REQUEST_DECODE_TIME = "vllm:request_decode_time_seconds"
REQUEST_INFERENCE_TIME = "vllm:request_inference_time_seconds"
REQUEST_TIME_PER_OUTPUT_TOKEN = "vllm:request_time_per_output_token_seconds"
REQUEST_PARAMS_MAX_TOKENS = "vllm:request_params_max_tokens"
REQUEST_PARAMS_N = "vllm:request_params_n"
REQUEST_MAX_NUM_GENERATION_TOKENS = "vllm:request_max_num_generation_tokens"
REQUEST_PREFILL_KV_COMPUTED_TOKENS = "vllm:request_prefill_kv_computed_tokens"
REQUEST_NUM_PREEMPTIONS = "vllm:request_num_preemptions"
CACHE_CONFIG_INFO = "vllm:cache_config_info"
KV_BLOCK_LIFETIME = "vllm:kv_block_lifetime_seconds"
KV_BLOCK_IDLE_BEFORE_EVICT = "vllm:kv_block_idle_before_evict_seconds"
KV_BLOCK_REUSE_GAP = "vllm:kv_block_reuse_gap_seconds"
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
REQUEST_SUCCESS = "vllm:request_success"
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
E2E_REQUEST_LATENCY = "vllm:e2e_request_latency_seconds"
NIXL_XFER_TIME = "vllm:nixl_xfer_time_seconds"
NIXL_BYTES_TRANSFERRED = "vllm:nixl_bytes_transferred"
NIXL_NUM_FAILED_TRANSFERS = "vllm:nixl_num_failed_transfers"
NIXL_NUM_KV_EXPIRED_REQS = "vllm:nixl_num_kv_expired_reqs"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
NIXL_XFER_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
# vLLM's FinishReason names: `vllm:request_success` has a series for each from the start (at 0)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
NIXL_BYTES_BUCKETS = tuple(2 ** (10 + i) for i in range(1, 25, 2))   # 2 KiB .. 8 GiB


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets, up to the max model length)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


def label_values(model_name: str) -> dict[str, str]:
    return {"model_name": model_name, "engine": ENGINE_INDEX}
