"""The engine's gauges and counters, from a snapshot the engine thread keeps (no locks, no live reads).

The engine thread refreshes `LLMEngine.stats` (a frozen snapshot) after every step and every inbox item; a
scrape on the HTTP thread reads that snapshot, never the live structures.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from hybridpd.engine.engine import LLMEngine


class EngineCollector:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(self)

    def describe(self) -> list[Metric]:
        return []  # collected lazily; names are not known to clash

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats
        yield GaugeMetricFamily("hybridpd:num_requests_running", "Requests in the running batch",
                                value=stats.num_running)
        yield GaugeMetricFamily("hybridpd:num_requests_waiting", "Requests waiting to be scheduled",
                                value=stats.num_waiting)
        yield GaugeMetricFamily("hybridpd:num_requests_waiting_for_remote_kv",
                                "Requests whose prompt KV is being pulled from a prefill node",
                                value=stats.num_loading)
        yield GaugeMetricFamily("hybridpd:kv_cache_usage_perc", "Fraction of KV blocks in use (max over groups)",
                                value=stats.kv_usage)
        labels = ["group", "kind"]
        free = GaugeMetricFamily("hybridpd:kv_free_blocks", "Free blocks per KV group (cached ones included)",
                                 labels=labels)
        total = GaugeMetricFamily("hybridpd:kv_total_blocks", "Usable blocks per KV group", labels=labels)
        cached = GaugeMetricFamily("hybridpd:kv_cached_blocks", "Blocks holding a prefix hash per KV group",
                                   labels=labels)
        queries = CounterMetricFamily("hybridpd:prefix_cache_queries", "Prompt tokens looked up per KV group",
                                      labels=labels)
        hits = CounterMetricFamily("hybridpd:prefix_cache_hits", "Prompt tokens served from the prefix cache per "
                                   "KV group", labels=labels)
        for group in stats.groups:
            key = [str(group.group_id), group.kind]
            free.add_metric(key, group.num_free)
            total.add_metric(key, group.num_total)
            cached.add_metric(key, group.num_cached)
            queries.add_metric(key, group.query_tokens)
            hits.add_metric(key, group.hit_tokens)
        yield from (free, total, cached, queries, hits)
        yield CounterMetricFamily("hybridpd:engine_prompt_tokens", "Prompt tokens admitted",
                                  value=stats.prompt_tokens)
        yield CounterMetricFamily("hybridpd:engine_generation_tokens", "Tokens generated",
                                  value=stats.generation_tokens)
