"""`hybridpd bench [FLAGS]` (like `vllm bench serve`) and `hybridpd bench plot RESULT.json... --out F.png`.

`plot` is an optional sub-command of `bench`: without it, `bench` runs a benchmark; with it, only
the plot's own arguments apply. Exit codes: 0 done (even with failed requests, which are counted),
2 bad arguments / unreachable server / unreadable input.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from datetime import datetime
from typing import Any

import aiohttp

from hybridpd.bench import plot
from hybridpd.bench.cli_args import add_benchmark_arguments
from hybridpd.bench.client import EndpointTarget
from hybridpd.bench.config import (
    DEFAULT_RANDOM_VOCAB_SIZE,
    BenchConfig,
    DatasetName,
    EndpointKind,
    config_from_args,
)
from hybridpd.bench.datasets import build_workload
from hybridpd.bench.metrics import compute_metrics
from hybridpd.bench.prometheus import counter_delta, scrape_counters
from hybridpd.bench.report import RunInfo, build_result, format_errors, format_table, result_path, save_result
from hybridpd.bench.runner import run_requests
from hybridpd.bench.server_info import ModelCard, ServerInfoError, fetch_model_card
from hybridpd.errors import HybridPDError
from hybridpd.gc_heap import startup_heap_frozen

SESSION_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_benchmark_arguments(parser)
    sub = parser.add_subparsers(dest="bench_command", metavar="{plot}")
    plot.add_arguments(sub.add_parser("plot", help="draw TTFT and ITL distributions of saved results"))


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "plot":
        return plot.run(args)
    try:
        asyncio.run(benchmark(config_from_args(args)))
    except (ValueError, HybridPDError) as exc:
        print(f"hybridpd bench: error: {exc}")
        return 2
    return 0


def bench_result(argv: list[str]) -> dict[str, Any]:
    """Run `hybridpd bench ARGV...` in this process and return its result dict (the saved JSON's
    content, saved too if `--save-result`); for scripts such as benchmarks/pd_vs_colocated.py.
    Raises ValueError / HybridPDError where the command would exit 2 (argparse itself still exits on
    an unknown flag)."""
    parser = argparse.ArgumentParser(prog="hybridpd bench")
    add_benchmark_arguments(parser)
    args = parser.parse_args(argv)
    return asyncio.run(benchmark(config_from_args(args)))


def _vocab_size(config: BenchConfig, card: ModelCard | None) -> int:
    """`--random-vocab-size` if given, else what the server reports, else a byte-safe default."""
    if config.random.vocab_size is not None:
        return config.random.vocab_size
    if card is not None and card.vocab_size is not None:
        return card.vocab_size
    return DEFAULT_RANDOM_VOCAB_SIZE


async def _model_card(session: aiohttp.ClientSession, config: BenchConfig) -> ModelCard | None:
    """Required when --model is missing; otherwise only a hint for the vocabulary size."""
    needs_vocab = config.dataset is not DatasetName.CUSTOM and config.random.vocab_size is None
    if config.model is not None and not needs_vocab:
        return None
    try:
        return await fetch_model_card(session, config.base_url)
    except ServerInfoError:
        if config.model is None:
            raise
        return None


async def benchmark(config: BenchConfig) -> dict[str, Any]:
    """One run: prints the table (and first errors), saves the JSON if asked, returns the result dict."""
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or 0)
    key = os.environ.get("OPENAI_API_KEY")   # as `vllm bench serve`: a server started with --api-key asks for it
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession(connector=connector, timeout=SESSION_TIMEOUT, headers=headers) as session:
        card = await _model_card(session, config)
        model_id = config.model or (card.model_id if card else "")
        workload = build_workload(config, vocab_size=_vocab_size(config, card))
        samples = workload.samples
        if config.endpoint_kind is EndpointKind.CHAT and not all(isinstance(s.prompt, str) for s in samples):
            raise ValueError(f"{config.endpoint} needs text prompts: use --dataset-name custom with text prompts")
        target = EndpointTarget(
            api_url=config.api_url, kind=config.endpoint_kind, model=model_id,
            ignore_eos=config.ignore_eos, sampling=config.sampling,
        )
        offsets = workload.offsets_s
        distribution = "Poisson process" if config.burstiness == 1.0 else "Gamma distribution"
        print(f"Model: {model_id}  endpoint: {config.api_url}  dataset: {config.dataset.value}")
        print(f"Traffic request rate: {config.request_rate}")
        print(f"Burstiness factor: {config.burstiness} ({distribution})")
        print(f"Maximum request concurrency: {config.max_concurrency}")
        before = await scrape_counters(session, config.metrics_urls)
        with startup_heap_frozen():   # the prompts and the modules: a full collection would stall every stream
            outcome = await run_requests(
                session, target, samples, offsets_s=offsets,
                max_concurrency=config.max_concurrency, disable_tqdm=config.disable_tqdm,
            )
        after = await scrape_counters(session, config.metrics_urls)
    metrics = compute_metrics(
        outcome.outputs, duration_s=outcome.duration_s, percentiles=config.metric_percentiles,
        goodput_slos_ms=config.goodput, kv_bytes_read=counter_delta(before, after),
        ideal_hit_rate=workload.ideal_hit_rate,
    )
    for line in format_errors(outcome.outputs) + format_table(metrics, config, outcome.duration_s):
        print(line)
    if metrics.completed == 0:
        print("WARNING: all requests failed; check the server and the benchmark arguments.")
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    info = RunInfo(date=date, model_id=model_id, duration_s=outcome.duration_s)
    result = build_result(metrics, outcome.outputs, config, info)
    if config.save_result:
        path = save_result(result, result_path(config, model_id=model_id, date=date))
        print(f"Result saved to {path}")
    return result

