"""The engine's gauges and counters, from a snapshot the engine thread keeps (no locks, no live reads).

The engine thread refreshes `LLMEngine.stats` (a frozen snapshot) after every step and every inbox item; a
scrape on the HTTP thread reads that snapshot, never the live structures.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from hybridpd import vllm_metrics as vm
from hybridpd.engine.engine import LLMEngine
from hybridpd.engine.histogram import HistogramSnapshot
from hybridpd.engine.kv_offload.tier import TierCounters
from hybridpd.engine.prompt_sources import PromptSources


class EngineCollector:
    """vLLM's scheduler gauges (hybridpd/vllm_metrics.py) and our per-group figures, which vLLM has no name for: a
    hybrid operator wants hits per full-attention, sliding-window and Mamba group."""

    def __init__(self, engine: LLMEngine, model_name: str = "model") -> None:
        self.engine = engine
        self._labels = list(vm.label_values(model_name).values())

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(self)

    def _histogram(self, name: str, doc: str, snapshot: HistogramSnapshot) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=vm.LABELS)
        family.add_metric(self._labels, snapshot.cumulative(), snapshot.total)
        return family

    def describe(self) -> list[Metric]:
        return []  # collected lazily; names are not known to clash

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats
        fetching = stats.num_loading + stats.num_loaded   # vLLM keeps these in its waiting queue too
        for name, doc, value in (
            (vm.NUM_REQUESTS_RUNNING, "Number of requests in model execution batches.", stats.num_running),
            (vm.NUM_REQUESTS_WAITING, "Number of requests waiting to be processed.", stats.num_waiting + fetching),
            (vm.KV_CACHE_USAGE_PERC, "KV-cache usage. 1 means 100 percent usage.", stats.kv_usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=vm.LABELS)
            gauge.add_metric(self._labels, value)
            yield gauge
        by_reason = GaugeMetricFamily(vm.NUM_REQUESTS_WAITING_BY_REASON, "Number of waiting requests by reason. "
                                      "Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = "
                                      "deferred by transient constraints (KV transfer). Sum of all reasons equals "
                                      "vllm:num_requests_waiting.", labels=[*vm.LABELS, "reason"])
        by_reason.add_metric([*self._labels, "capacity"], stats.num_waiting)
        by_reason.add_metric([*self._labels, "deferred"], fetching)
        yield by_reason
        by_stage = GaugeMetricFamily(vm.NUM_REQUESTS_KV_FETCH_BY_STAGE, "Number of waiting requests by async KV load "
                                     "stage. Stage labels: 'waiting_to_start' = needs an async KV load that has not "
                                     "started; 'in_progress' = load started and not yet reported finished; "
                                     "'completed_waiting' = load finished, request not running yet.",
                                     labels=[*vm.LABELS, "stage"])
        for stage, value in (("waiting_to_start", stats.num_remote_waiting), ("in_progress", stats.num_loading),
                             ("completed_waiting", stats.num_loaded)):
            by_stage.add_metric([*self._labels, stage], value)
        yield by_stage
        labels = ["group", "kind"]
        free = GaugeMetricFamily("hybridpd:kv_free_blocks", "Free blocks per KV group (cached ones included)",
                                 labels=labels)
        total = GaugeMetricFamily("hybridpd:kv_total_blocks", "Usable blocks per KV group", labels=labels)
        cached = GaugeMetricFamily("hybridpd:kv_cached_blocks", "Blocks holding a prefix hash per KV group",
                                   labels=labels)
        queries = CounterMetricFamily("hybridpd:group_prefix_cache_queries", "Prompt tokens looked up per KV group",
                                      labels=labels)
        hits = CounterMetricFamily("hybridpd:group_prefix_cache_hits", "Prompt tokens served from the prefix cache per "
                                   "KV group", labels=labels)
        for group in stats.groups:
            key = [str(group.group_id), group.kind]
            free.add_metric(key, group.num_free)
            total.add_metric(key, group.num_total)
            cached.add_metric(key, group.num_cached)
            queries.add_metric(key, group.query_tokens)
            hits.add_metric(key, group.hit_tokens)
        yield from (free, total, cached, queries, hits)
        if stats.cache_info:
            info = GaugeMetricFamily(vm.CACHE_CONFIG_INFO, "Information of the LLMEngine CacheConfig",
                                     labels=[*(name for name, _ in stats.cache_info), "engine"])
            info.add_metric([*(value for _, value in stats.cache_info), vm.ENGINE_INDEX], 1)
            yield info
        yield from _prompt_source_metrics(stats.prompt_sources, self._labels)
        preemptions = CounterMetricFamily(vm.NUM_PREEMPTIONS, "Cumulative number of preemption from the engine.",
                                          labels=vm.LABELS)
        preemptions.add_metric(self._labels, stats.preemptions)
        yield preemptions
        yield self._histogram(vm.ITERATION_TOKENS, "Histogram of number of tokens per engine_step.",
                              stats.step_tokens)
        if stats.residency is not None:
            residency = stats.residency
            for name, doc, snapshot in (
                (vm.KV_BLOCK_LIFETIME, "Histogram of KV cache block lifetime from allocation to eviction. Sampled "
                 "metrics (controlled by --kv-cache-metrics-sample).", residency.lifetime),
                (vm.KV_BLOCK_IDLE_BEFORE_EVICT, "Histogram of idle time before KV cache block eviction. Sampled "
                 "metrics (controlled by --kv-cache-metrics-sample).", residency.idle_before_evict),
                (vm.KV_BLOCK_REUSE_GAP, "Histogram of time gaps between consecutive KV cache block accesses. Only "
                 "the most recent accesses are recorded (ring buffer). Sampled metrics (controlled by "
                 "--kv-cache-metrics-sample).", residency.reuse_gap),
            ):
                yield self._histogram(name, doc, snapshot)
        yield CounterMetricFamily("hybridpd:engine_prompt_tokens", "Prompt tokens admitted",
                                  value=stats.prompt_tokens)
        yield CounterMetricFamily("hybridpd:engine_generation_tokens", "Tokens generated",
                                  value=stats.generation_tokens)
        if stats.offload is not None:
            yield from _offload_metrics(stats.offload)


def _prompt_source_metrics(sources: PromptSources, labels: list[str]) -> Iterator[Metric]:
    """vLLM's prefix-cache and prompt-source counters (engine/prompt_sources.py), from the admissions."""
    for name, doc, value in (
        (vm.PREFIX_CACHE_QUERIES, "Prefix cache queries, in terms of number of queried tokens.", sources.queries),
        (vm.PREFIX_CACHE_HITS, "Prefix cache hits, in terms of number of cached tokens.", sources.local_hits),
        (vm.EXTERNAL_PREFIX_CACHE_QUERIES, "External prefix cache queries from KV connector cross-instance cache "
         "sharing, in terms of number of queried tokens.", sources.external_queries),
        (vm.EXTERNAL_PREFIX_CACHE_HITS, "External prefix cache hits from KV connector cross-instance cache sharing, "
         "in terms of number of cached tokens.", sources.external_hits),
        (vm.PROMPT_TOKENS_CACHED, "Number of cached prompt tokens (local + external).", sources.cached),
    ):
        counter = CounterMetricFamily(name, doc, labels=vm.LABELS)
        counter.add_metric(labels, value)
        yield counter
    by_tier = CounterMetricFamily(vm.PROMPT_TOKENS_CACHED_BY_SOURCE, "Prefix-cache hit tokens by the cache tier that "
                                  "supplied them: device (this node's memory), p2p (pulled from a prefill node) or "
                                  "disk (the storage tier). Counted at admission; sums to vllm:prefix_cache_hits + "
                                  "vllm:external_prefix_cache_hits.", labels=[*vm.LABELS, "source"])
    for source, value in sources.cached_by_source().items():
        by_tier.add_metric([*labels, source.value], value)
    yield by_tier
    by_source = CounterMetricFamily(vm.PROMPT_TOKENS_BY_SOURCE, "Number of prompt tokens by source.",
                                    labels=[*vm.LABELS, "source"])
    for source, value in sources.by_source().items():
        by_source.add_metric([*labels, source.value], value)
    yield by_source


def _offload_metrics(counters: TierCounters) -> Iterator[Metric]:
    """The storage tier (--kv-offload-dir): what it wrote behind and dropped, and the hits it served."""
    yield CounterMetricFamily("hybridpd:kv_offload_written_blocks", "Blocks written to the storage tier",
                              value=counters.written)
    dropped = CounterMetricFamily("hybridpd:kv_offload_dropped_blocks", "Blocks the write-behind dropped",
                                  labels=["reason"])
    dropped.add_metric(["queue_full"], counters.dropped_queue_full)
    dropped.add_metric(["write_error"], counters.dropped_write_error)
    yield dropped
    yield CounterMetricFamily("hybridpd:kv_offload_hits", "Requests that took a prefix hit from the storage tier",
                              value=counters.hits)
    yield CounterMetricFamily("hybridpd:kv_offload_hit_tokens", "Prompt tokens served from the storage tier beyond "
                              "the memory hit", value=counters.hit_tokens)
    yield CounterMetricFamily("hybridpd:kv_offload_loaded_blocks", "Blocks read from the storage tier",
                              value=counters.loaded_blocks)
    yield CounterMetricFamily("hybridpd:kv_offload_load_misses", "Storage reads that found a block gone or bad (the "
                              "prompt was computed instead)", value=counters.load_misses)
    yield CounterMetricFamily("hybridpd:kv_offload_load_timeouts", "Storage reads given up after --kv-load-timeout "
                              "(the prompt was computed instead)", value=counters.load_timeouts)
    loads = HistogramMetricFamily("hybridpd:kv_offload_load_seconds", "Seconds from a request's storage read being "
                                  "asked for to its end (behind the reads before it included)")
    loads.add_metric([], counters.load_seconds.cumulative(), counters.load_seconds.total)
    yield loads
    cpu = CounterMetricFamily("hybridpd:kv_offload_thread_cpu_seconds", "CPU time of the storage tier's threads: the "
                              "writer and the loader (each its process and the thread that talks to it) and the scanner (not "
                              "the engine thread's offers and hit searches)",
                              labels=["thread"])
    cpu.add_metric(["writer"], counters.writer_cpu_s)
    cpu.add_metric(["loader"], counters.loader_cpu_s)
    cpu.add_metric(["scanner"], counters.scanner_cpu_s)
    yield cpu
