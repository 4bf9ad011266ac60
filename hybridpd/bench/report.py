"""vLLM's printed result table and JSON result, plus our lines (hit rate, a trace slice's ideal hit rate, KV bytes
read)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridpd.bench.client import RequestOutput
from hybridpd.bench.config import BenchConfig
from hybridpd.bench.metrics import BenchmarkMetrics

WIDTH = 50
SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)
MAX_ERRORS_SHOWN = 10


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """What the result records about the run besides its metrics."""

    date: str            # %Y%m%d-%H%M%S
    model_id: str
    duration_s: float


def percentile_word(p: float) -> str:
    """99.0 -> "99", 99.9 -> "99.9": the suffix of vLLM's `p99_ttft_ms` keys and `P99 TTFT` lines."""
    return str(int(p)) if int(p) == p else str(p)


def _row(label: str, value: object, fmt: str = "") -> str:
    shown = "n/a" if value is None else format(value, fmt)
    return f"{label:<40} {shown:<10}"


def format_table(metrics: BenchmarkMetrics, config: BenchConfig, duration_s: float) -> list[str]:
    lines = [f"{' Serving Benchmark Result ':=^{WIDTH}}"]
    lines.append(_row("Successful requests:", metrics.completed))
    lines.append(_row("Failed requests:", metrics.failed))
    if config.max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", config.max_concurrency))
    if not math.isinf(config.request_rate):
        lines.append(_row("Request rate configured (RPS):", config.request_rate, ".2f"))
    lines.append(_row("Benchmark duration (s):", duration_s, ".2f"))
    lines.append(_row("Total input tokens:", metrics.total_input))
    lines.append(_row("Total generated tokens:", metrics.total_output))
    lines.append(_row("Request throughput (req/s):", metrics.request_throughput, ".2f"))
    if metrics.request_goodput is not None:
        lines.append(_row("Request goodput (req/s):", metrics.request_goodput, ".2f"))
    lines.append(_row("Output token throughput (tok/s):", metrics.output_throughput, ".2f"))
    lines.append(_row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s, ".2f"))
    lines.append(_row("Peak concurrent requests:", float(metrics.max_concurrent_requests), ".2f"))
    lines.append(_row("Total token throughput (tok/s):", metrics.total_token_throughput, ".2f"))
    lines.append(_row("Prefix cache hit rate:", metrics.prefix_cache_hit_rate, ".4f"))
    if metrics.ideal_prefix_cache_hit_rate is not None:
        lines.append(_row("Ideal prefix cache hit rate (trace):", metrics.ideal_prefix_cache_hit_rate, ".4f"))
    lines.append(_row("KV bytes read:", metrics.kv_bytes_read))
    for key, name, header in SECTIONS:
        if key not in config.percentile_metrics:
            continue
        stats = metrics.stats(key)
        lines.append(f"{header:-^{WIDTH}}")
        lines.append(_row(f"Mean {name} (ms):", stats.mean_ms, ".2f"))
        lines.append(_row(f"Median {name} (ms):", stats.median_ms, ".2f"))
        for p, value in stats.percentiles_ms:
            lines.append(_row(f"P{percentile_word(p)} {name} (ms):", value, ".2f"))
    lines.append("=" * WIDTH)
    return lines


def format_errors(outputs: Sequence[RequestOutput]) -> list[str]:
    failed = [o for o in outputs if not o.success]
    if not failed:
        return []
    lines = [f"Failed requests during benchmark run detected (capping to {MAX_ERRORS_SHOWN}):"]
    lines += [f"Error {i}: {o.error}" for i, o in enumerate(failed[:MAX_ERRORS_SHOWN])]
    return lines


def build_result(
    metrics: BenchmarkMetrics, outputs: Sequence[RequestOutput], config: BenchConfig, info: RunInfo
) -> dict[str, Any]:
    """vLLM's keys (setup, totals, throughputs, per-request lists, mean/median/std/pNN per metric
    for all four metrics) plus `prefix_cache_hit_rate`, `kv_bytes_read`, `cached_tokens`."""
    result: dict[str, Any] = {
        "date": info.date,
        "endpoint_type": config.backend_name,
        "backend": config.backend_name,
        "label": config.label,
        "model_id": info.model_id,
        "tokenizer_id": None,
        "num_prompts": config.num_prompts,
        "dataset_name": config.dataset.value,
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "duration": info.duration_s,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        "prefix_cache_hit_rate": metrics.prefix_cache_hit_rate,
        "ideal_prefix_cache_hit_rate": metrics.ideal_prefix_cache_hit_rate,
        "kv_bytes_read": metrics.kv_bytes_read,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": list(metrics.output_lens),
        "ttfts": [o.ttft for o in outputs],
        "itls": [list(o.itl) for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "cached_tokens": [o.cached_tokens for o in outputs],
        "errors": [o.error for o in outputs],
    }
    for key, _, _ in SECTIONS:
        stats = metrics.stats(key)
        result[f"mean_{key}_ms"] = stats.mean_ms
        result[f"median_{key}_ms"] = stats.median_ms
        result[f"std_{key}_ms"] = stats.std_ms
        for p, value in stats.percentiles_ms:
            result[f"p{percentile_word(p)}_{key}_ms"] = value
    return result


def result_path(config: BenchConfig, *, model_id: str, date: str) -> Path:
    """vLLM's default name `{label}-{rate}qps[-concurrencyN]-{model}-{date}.json`, or
    `--result-filename`; inside `--result-dir` when given."""
    label = config.label or config.backend_name
    concurrency = f"-concurrency{config.max_concurrency}" if config.max_concurrency is not None else ""
    name = config.result_filename or (
        f"{label}-{config.request_rate}qps{concurrency}-{model_id.split('/')[-1]}-{date}.json"
    )
    return (config.result_dir / name) if config.result_dir else Path(name)


def save_result(result: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result), encoding="utf-8")
    return path
