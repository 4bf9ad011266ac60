"""The conversation trace's bursts through one engine, first come first served against shortest job first.

The Mooncake conversation trace's requests arrive in bursts (every 3 s, 5-20 requests at the same instant). This
takes `--bursts` of them from `--trace-start`, prompt lengths at `--tokens-per-hash` tokens per hash id, and gives one
engine (the default preset, one thread, in-process, prefix caching off: every prompt computed whole) the share of
each burst one of `--nodes` prefill nodes gets under round robin: each burst's prompts are added at once, and the
engine steps until every one has its first token (`max_tokens` 1, as a prefill node serves them). Two engines, one per
`--scheduling-policy` (fcfs; sjf with its defaults), the same bursts, rounds alternated.

Last line: JSON with `mean_ttft_ratio` (sjf over fcfs: the mean over every request of the time from its burst's
arrival to its first token), `burst_time_ratio` (sjf over fcfs: each burst's time to its last first token, summed:
what the order costs in throughput), the raw figures per policy and round, the CPU model and the date.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch

from hybridpd.bench import mooncake
from hybridpd.config import CacheConfig, EngineConfig, SchedulerConfig, SchedulingPolicy
from hybridpd.engine.dtype_choice import this_cpus_model
from hybridpd.engine.engine import LLMEngine
from hybridpd.engine.request import EngineRequest
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.presets.checkpoints import default_model_dir

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def bursts(args: argparse.Namespace) -> list[list[int]]:
    """Prompt lengths of one node's share of each burst (requests with the same arrival time), in arrival order."""
    trace = mooncake.TraceSlice(tokens_per_hash=args.tokens_per_hash, start_s=args.trace_start)
    records = [r for r in mooncake.select(mooncake.read_trace(args.trace), trace)
               if mooncake.scaled_length(r, args.tokens_per_hash) < args.max_model_len]
    groups = [list(group) for _, group in itertools.groupby(records, key=lambda r: r.timestamp_ms)][:args.bursts]
    return [[mooncake.scaled_length(r, args.tokens_per_hash) for r in group[::args.nodes]] for group in groups]


def make_engine(args: argparse.Namespace, policy: SchedulingPolicy) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=default_model_dir(args.preset), dtype=args.dtype,
                                  cache=CacheConfig(enable_prefix_caching=False),
                                  scheduler=SchedulerConfig(max_model_len=args.max_model_len,
                                                            scheduling_policy=policy)))


def serve_burst(engine: LLMEngine, lengths: list[int], generator: torch.Generator) -> tuple[list[float], float]:
    """Each prompt's time from the burst's arrival to its first token, and the burst's time to its last."""
    start = time.perf_counter()
    first: dict[str, float] = {}
    for i, length in enumerate(lengths):
        ids = tuple(torch.randint(0, 250, (length,), generator=generator).tolist())
        engine.add_request(EngineRequest(request_id=f"b{time.monotonic_ns()}-{i}", prompt_token_ids=ids,
                                         sampling=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    while engine.has_work():
        for output in engine.step():
            first.setdefault(output.request_id, time.perf_counter() - start)
    return list(first.values()), time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens-per-hash", type=int, default=16)
    parser.add_argument("--trace-start", type=float, default=1800.0)
    parser.add_argument("--bursts", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=2, help="the prefill nodes a burst is shared by (round robin)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    if args.bursts < 1 or args.nodes < 1 or args.rounds < 1:
        parser.error("--bursts, --nodes and --rounds must be >= 1")
    torch.set_num_threads(1)
    work = bursts(args)
    print(f"{len(work)} bursts, {sum(map(len, work))} prompts, {sum(map(sum, work))} tokens on this node", flush=True)
    policies = (SchedulingPolicy.FCFS, SchedulingPolicy.SJF)
    engines = {policy: make_engine(args, policy) for policy in policies}
    generator = torch.Generator().manual_seed(0)
    for engine in engines.values():   # warm-up
        serve_burst(engine, [300, 40, 120], generator)
    figures: dict[str, list[dict[str, float]]] = {policy.value: [] for policy in policies}
    for r in range(args.rounds):
        for policy in policies if r % 2 == 0 else policies[::-1]:
            ttfts, totals = [], []
            for lengths in work:
                firsts, total = serve_burst(engines[policy], lengths, generator)
                ttfts += firsts
                totals.append(total)
            figures[policy.value].append({"mean_ttft_ms": statistics.mean(ttfts) * 1e3,
                                          "p90_ttft_ms": statistics.quantiles(ttfts, n=10)[-1] * 1e3,
                                          "burst_time_s": sum(totals)})
            print(f"round {r} {policy.value}: {figures[policy.value][-1]}", flush=True)

    def mean(policy: str, key: str) -> float:
        return statistics.mean(run[key] for run in figures[policy])

    print(json.dumps({
        "mean_ttft_ratio": round(mean("sjf", "mean_ttft_ms") / mean("fcfs", "mean_ttft_ms"), 3),
        "p90_ttft_ratio": round(mean("sjf", "p90_ttft_ms") / mean("fcfs", "p90_ttft_ms"), 3),
        "burst_time_ratio": round(mean("sjf", "burst_time_s") / mean("fcfs", "burst_time_s"), 3),
        "policies": {policy: [{k: round(v, 4) for k, v in run.items()} for run in runs]
                     for policy, runs in figures.items()},
        "bursts": len(work), "prompts": sum(map(len, work)), "tokens": sum(map(sum, work)),
        "args": {k: str(v) for k, v in vars(args).items()}, "cpu": this_cpus_model(),
        "date": time.strftime("%Y-%m-%d"),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
