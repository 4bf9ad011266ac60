"""The flags of `hybridpd bench`: `vllm bench serve`'s names, defaults and meanings, plus ours."""

from __future__ import annotations

import argparse

from hybridpd.bench.config import DEFAULT_RANDOM_VOCAB_SIZE, DatasetName


def _add_target(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--base-url", default=None, help="server base URL (else http://HOST:PORT)")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    group.add_argument("--backend", default=None, choices=["openai", "vllm", "openai-chat"],
                       help="recorded in the result (default: from --endpoint); the endpoint decides the wire shape")
    group.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    group.add_argument("--metrics-url", nargs="+", default=None, metavar="URL",
                       help="node /metrics pages scraped before and after for kv_bytes_read")


def _add_datasets(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset-name", default="random", choices=[d.value for d in DatasetName])
    group.add_argument("--dataset-path", default=None,
                       help="custom: a JSONL file, one {\"prompt\", \"output_tokens\"?} a line; mooncake_trace: the trace")
    group.add_argument("--num-prompts", type=int, default=1000)
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--random-input-len", type=int, default=1024)
    group.add_argument("--random-output-len", type=int, default=128)
    group.add_argument("--random-range-ratio", type=float, default=0.0,
                       help="lengths drawn uniformly from [L*(1-r), L*(1+r)]")
    group.add_argument("--random-prefix-len", type=int, default=0, help="random tokens shared by every prompt")
    group.add_argument("--random-vocab-size", type=int, default=None,
                       help=f"token ids are < this (default: the server's vocab_size, else {DEFAULT_RANDOM_VOCAB_SIZE}); "
                            "also used by prefix_repetition")
    group.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    group.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    group.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    group.add_argument("--prefix-repetition-output-len", type=int, default=128)
    group.add_argument("--custom-output-len", type=int, default=256, help="custom: for lines without output_tokens")
    trace = parser.add_argument_group("mooncake_trace (a Mooncake trace: arrival times and shared prefix blocks)")
    trace.add_argument("--trace-tokens-per-hash", type=int, default=512,
                       help="tokens per hash id (512 as published; fewer scale every length down)")
    trace.add_argument("--trace-time-scale", type=float, default=1.0,
                       help="the replay's times are the trace's times this many times (0.1: ten times faster)")
    trace.add_argument("--trace-start", type=float, default=0.0, help="seconds into the trace where the slice starts")
    trace.add_argument("--trace-duration", type=float, default=None, help="seconds of trace in the slice")
    trace.add_argument("--trace-max-requests", type=int, default=None, help="at most this many requests of the slice")
    trace.add_argument("--trace-max-output-len", type=int, default=None, help="cap every request's output length")


def _add_traffic(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("traffic")
    group.add_argument("--request-rate", type=float, default=float("inf"),
                       help="requests per second; inf sends all at time 0")
    group.add_argument("--burstiness", type=float, default=1.0,
                       help="gamma shape of the inter-arrival times: 1 Poisson, < 1 burstier, > 1 more even")
    group.add_argument("--max-concurrency", type=int, default=None)
    group.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                       help="send ignore_eos (default: on for random and prefix_repetition, off for custom)")
    # vLLM bench's sampling flags: each sent only when given
    group.add_argument("--temperature", type=float, default=None)
    group.add_argument("--top-p", type=float, default=None)
    group.add_argument("--top-k", type=int, default=None)
    group.add_argument("--min-p", type=float, default=None)
    group.add_argument("--frequency-penalty", type=float, default=None)
    group.add_argument("--presence-penalty", type=float, default=None)
    group.add_argument("--repetition-penalty", type=float, default=None)
    group.add_argument("--disable-tqdm", action="store_true")


def _add_results(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("results")
    group.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                       help="comma-separated, from ttft,tpot,itl,e2el: the sections printed")
    group.add_argument("--metric-percentiles", default="99", help='comma-separated percentiles, e.g. "50,90,99"')
    group.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                       help="SLOs for goodput, e.g. ttft:200 tpot:50 e2el:2000")
    group.add_argument("--save-result", action="store_true")
    group.add_argument("--result-dir", default=None)
    group.add_argument("--result-filename", default=None)
    group.add_argument("--label", default=None, help="result label (default: the backend name)")


def add_benchmark_arguments(parser: argparse.ArgumentParser) -> None:
    _add_target(parser)
    _add_datasets(parser)
    _add_traffic(parser)
    _add_results(parser)
