"""vLLM's serving metrics, as pure functions of the recorded timings.

Definitions (those of `vllm bench serve`, over successful requests only):
- TTFT: send -> first token chunk. E2EL: send -> last token chunk.
- TPOT: (E2EL - TTFT) / (output_len - 1), only for output_len > 1 (counted as 0 for goodput).
- ITL: every gap between consecutive token chunks of a request, all requests pooled.
- mean / median / std / percentiles with numpy (`np.percentile`, linear interpolation); an empty
  list counts as [0]. Throughputs are totals over the benchmark duration; goodput is the number of
  requests meeting every SLO (value <= SLO) over the duration.
- peak concurrency: the most requests in flight at once, intervals [start, start + E2EL) swept
  with departures before arrivals at equal times.
Ours: prefix_cache_hit_rate = Σ cached_tokens / Σ prompt tokens (None when no answer reported
cached tokens); kv_bytes_read is passed in (the nodes' counter delta, None when not scraped).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hybridpd.bench.client import RequestOutput


@dataclass(frozen=True, kw_only=True)
class LatencyStats:
    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: tuple[tuple[float, float], ...]   # (percentile, value in ms)


@dataclass(frozen=True, kw_only=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None          # None when no --goodput SLO was given
    output_throughput: float
    total_token_throughput: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    prefix_cache_hit_rate: float | None
    kv_bytes_read: int | None
    output_lens: tuple[int, ...]           # per request, 0 for a failed one
    ideal_prefix_cache_hit_rate: float | None = None   # a trace slice's with an unbounded cache; None otherwise

    def stats(self, metric: str) -> LatencyStats:
        return {"ttft": self.ttft, "tpot": self.tpot, "itl": self.itl, "e2el": self.e2el}[metric]


def latency_stats(values_s: Sequence[float], percentiles: Sequence[float]) -> LatencyStats:
    data = list(values_s) or [0.0]
    return LatencyStats(
        mean_ms=float(np.mean(data)) * 1000,
        median_ms=float(np.median(data)) * 1000,
        std_ms=float(np.std(data)) * 1000,
        percentiles_ms=tuple((float(p), float(np.percentile(data, p)) * 1000) for p in percentiles),
    )


def tpot_seconds(output: RequestOutput) -> float | None:
    if output.output_len <= 1:
        return None
    return (output.latency - output.ttft) / (output.output_len - 1)


def count_good(outputs: Sequence[RequestOutput], slos_ms: Sequence[tuple[str, float]]) -> int:
    """Successful requests whose TTFT, TPOT (0 if output_len <= 1) and E2EL all meet their SLOs."""
    def value_s(output: RequestOutput, metric: str) -> float:
        if metric == "tpot":
            return tpot_seconds(output) or 0.0
        return output.ttft if metric == "ttft" else output.latency

    return sum(
        all(value_s(o, metric) <= slo / 1000 for metric, slo in slos_ms) for o in outputs if o.success
    )


def peak_concurrency(outputs: Sequence[RequestOutput]) -> int:
    events = sorted(
        [(o.start_time, 1) for o in outputs] + [(o.start_time + o.latency, -1) for o in outputs]
    )
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def peak_output_tokens_per_s(outputs: Sequence[RequestOutput]) -> float:
    """The most token chunks landing in one whole second after the first send (vLLM's buckets)."""
    if not outputs:
        return 0.0
    first = min(o.start_time for o in outputs)
    last = max(o.start_time + o.latency for o in outputs)
    buckets = np.zeros(int(math.ceil(last - first)) + 1)
    for o in outputs:
        times = np.cumsum([o.start_time + o.ttft, *o.itl]) - first
        for t in times:
            if 0 <= int(t) < len(buckets):
                buckets[int(t)] += 1
    return float(buckets.max())


def hit_rate(outputs: Sequence[RequestOutput]) -> float | None:
    if not any(o.cached_tokens is not None for o in outputs):
        return None
    prompt_tokens = sum(o.prompt_len for o in outputs)
    return sum(o.cached_tokens or 0 for o in outputs) / prompt_tokens if prompt_tokens else None


def compute_metrics(
    outputs: Sequence[RequestOutput],
    *,
    duration_s: float,
    percentiles: Sequence[float],
    goodput_slos_ms: Sequence[tuple[str, float]] = (),
    kv_bytes_read: float | None = None,
    ideal_hit_rate: float | None = None,
) -> BenchmarkMetrics:
    if not duration_s > 0:
        raise ValueError(f"benchmark duration must be positive, got {duration_s}")
    good = [o for o in outputs if o.success]
    output_lens = tuple(o.output_len if o.success else 0 for o in outputs)
    total_input = sum(o.prompt_len for o in good)
    total_output = sum(output_lens)
    tpots = [t for t in map(tpot_seconds, good) if t is not None]
    return BenchmarkMetrics(
        completed=len(good),
        failed=len(outputs) - len(good),
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(good) / duration_s,
        request_goodput=count_good(good, goodput_slos_ms) / duration_s if goodput_slos_ms else None,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        ttft=latency_stats([o.ttft for o in good], percentiles),
        tpot=latency_stats(tpots, percentiles),
        itl=latency_stats([gap for o in good for gap in o.itl], percentiles),
        e2el=latency_stats([o.latency for o in good], percentiles),
        max_output_tokens_per_s=peak_output_tokens_per_s(good),
        max_concurrent_requests=peak_concurrency(good),
        prefix_cache_hit_rate=hit_rate(good),
        kv_bytes_read=None if kv_bytes_read is None else int(round(kv_bytes_read)),
        output_lens=output_lens,
        ideal_prefix_cache_hit_rate=ideal_hit_rate,
    )
