"""The cluster simulator against the live cluster: the same trace slice, per routing policy, side by side, one run.

Live: `trace_replay.py`'s replay (a fresh 2 prefill + 2 decode `LocalCluster` per policy on the default preset, the
slice sent at its arrival times through the proxy, streamed, greedy; decode-side hit rate from the decode nodes'
cached tokens, TTFT at the client). Simulated: `hybridpd replay`'s `simulate` on the same records, the same node
memory and max length, the same policy, under a clock measured in this run: the model's step costs (`calibrate`,
the real engine here, one thread), the cores the nodes share (this machine's), what a request waits outside the
engine (the proxy's and nodes' HTTP hops: the median TTFT of a short request on the idle live cluster, less the
clock's prefill of it), and the CPU it costs there (the CPU seconds the cluster's processes and this client used
over the replay, less what the clock charges the engines for, per request). `--offload` adds the storage tier to
both (a fresh shared directory live, `--kv-offload-size` simulated); `--history S` has both first serve the S
seconds of trace before the slice, unmeasured (the probe and the CPU count start after it); `--pd-threshold` gives
cache_aware the proxy's flag on both.

Last line: JSON per policy with live and simulated decode-side hit rate and mean TTFT and their relative errors
(goals: hit rate within +-10%, mean TTFT within +-25%), the clock, the slice, the CPU model and the date.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from hybridpd.bench import mooncake
from hybridpd.engine.dtype_choice import this_cpus_model
from hybridpd.engine.model.loader import read_model_config
from hybridpd.presets.checkpoints import default_model_dir
from hybridpd.proxy.config import CostRule, RoutingPolicy
from hybridpd.replay.node import NodeLayout
from hybridpd.replay.simulator import ClusterShape, simulate
from hybridpd.replay.time_model import TimeModel, calibrate
from hybridpd.server.args import parse_size
from routing import one_request       # benchmarks/routing.py: one streamed greedy completion
from trace_replay import TRACE, load_history, load_slice, run_setup, sessions_cpu_s

PROBE_TOKENS = 16


def idle_ttfts(url: str, tokens: int, repeats: int = 7) -> list[float]:
    """TTFTs of a request of `tokens` tokens on the idle cluster (distinct prompts: no hit)."""
    async def run() -> list[float]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            return [(await one_request(session, url, [1 + k] * tokens, 1))["ttft"] for k in range(repeats)]
    return asyncio.run(run())


def probe(info: Any, tokens: int = PROBE_TOKENS):
    """On the idle cluster: the TTFTs of a short request (`tokens` long: past `--pd-threshold`, so that it is
    disaggregated, as the clock's `request_s` is); then the CPU the cluster and this client use over the replay."""
    ttfts = idle_ttfts(info.proxy_url, tokens)
    sessions = {node.pid for node in info.nodes} | {info.proxy_pid}
    cluster, client = sessions_cpu_s(sessions), time.process_time()

    def after() -> dict[str, Any]:
        return {"idle_ttfts": ttfts, "cpu_s": sessions_cpu_s(sessions) - cluster + time.process_time() - client}
    return after


def relative_error(simulated: float, live: float) -> float | None:
    return (simulated - live) / live if live else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--tokens-per-hash", type=int, default=16)
    parser.add_argument("--trace-start", type=float, default=0.0)
    parser.add_argument("--trace-duration", type=float, default=300.0)
    parser.add_argument("--max-requests", type=int, default=400)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--kv-cache-memory", default="48MiB")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"],
                        choices=["round_robin", "cache_aware"])
    parser.add_argument("--offload", action="store_true", help="the storage tier on both sides (4GiB)")
    parser.add_argument("--pd-threshold", type=int, default=0, metavar="TOKENS",
                        help="the proxy's --pd-threshold with cache_aware, on both sides; 0: always disaggregate")
    parser.add_argument("--history", type=float, default=0.0, metavar="S",
                        help="both sides first serve the S seconds of trace before --trace-start, unmeasured "
                             "(trace_replay.py's --history; simulated at the trace's own times)")
    parser.add_argument("--history-time-scale", type=float, default=0.25)
    args = parser.parse_args()
    if args.history < 0 or not args.history_time_scale > 0:
        parser.error("--history must be >= 0 and --history-time-scale positive")
    args.preset, args.rounds = "small", 1   # what trace_replay.run_setup reads

    model = default_model_dir(args.preset)
    trace, records, prompts, offsets = load_slice(args)
    history = load_history(args)
    seen = history.records if history else []
    vocab = read_model_config(model)[0].vocab_size
    print(f"replay_vs_live: {len(records)} requests over {offsets[-1]:.0f} s; calibrating the clock ...", file=sys.stderr,
          flush=True)
    measured = calibrate(model)
    memory = parse_size(args.kv_cache_memory)
    layout = NodeLayout.of(model, memory, 16, 32, args.max_model_len)

    out: dict[str, Any] = {}
    tokens = PROBE_TOKENS + args.pd_threshold   # the probe's prompt: disaggregated under the threshold too
    for policy in args.policies:
        setup = "tier" if args.offload else policy
        if args.offload and policy == "round_robin":
            parser.error("--offload compares cache_aware with the tier: give --policies cache_aware")
        print(f"replay_vs_live: {policy} live ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            live = run_setup(setup, args, prompts, offsets, Path(tmp) / "kv", probe=lambda info: probe(info, tokens),
                             history=history)
        request_s = max(0.0, statistics.median(live["probe"]["idle_ttfts"]) - measured.prefill_s(tokens))
        clock = TimeModel(**(measured.as_json() | {"request_s": request_s, "cores": os.cpu_count() or 1}))

        def run_sim(clock: TimeModel) -> dict[str, Any]:
            return simulate(records, trace, layout, ClusterShape(prefill=2, decode=2), RoutingPolicy(policy), clock,
                            vocab, CostRule(pd_threshold=args.pd_threshold if policy == "cache_aware" else 0),
                            offload_bytes=(4 << 30) if args.offload else None, history=seen)

        # What the cluster's CPU did beyond the engines' work the clock charges: per request, on the shared cores.
        engine_cpu_s = run_sim(clock)["engine_cpu_s"]
        request_cpu_s = max(0.0, live["probe"]["cpu_s"] - engine_cpu_s) / len(records)
        clock = TimeModel(**(clock.as_json() | {"request_cpu_s": request_cpu_s}))
        sim = run_sim(clock)
        live_ttft, sim_ttft = live["mean_ttft_ms"], sim["mean_ttft_s"] * 1e3
        out[setup] = {
            "live_decode_hit_rate": live["decode_hit_rate"], "simulated_decode_hit_rate": sim["decode_hit_rate"],
            "hit_rate_error": relative_error(sim["decode_hit_rate"], live["decode_hit_rate"]),
            "live_mean_ttft_ms": live_ttft, "simulated_mean_ttft_ms": sim_ttft,
            "mean_ttft_error": relative_error(sim_ttft, live_ttft),
            "live_p90_ttft_ms": live["p90_ttft_ms"], "simulated_p90_ttft_ms": sim["p90_ttft_s"] * 1e3,
            "clock": clock.as_json(), "live_cpu_s": live["probe"]["cpu_s"], "engine_cpu_s": engine_cpu_s,
        }
    print(json.dumps({**out, "goals": {"hit_rate_error": "within +-0.10", "mean_ttft_error": "within +-0.25"},
                      "requests": len(records), "history_requests": len(seen),
                      "ideal_hit_rate": ideal_hit_rate(records, args.tokens_per_hash, seen),
                      "slice": {k: v for k, v in vars(args).items() if k != "trace"} | {"trace": str(args.trace)},
                      "cpu": this_cpus_model(), "date": time.strftime("%Y-%m-%d")}))
    return 0


def ideal_hit_rate(records: list[mooncake.TraceRecord], tokens_per_hash: int,
                   history: list[mooncake.TraceRecord]) -> float:
    hits, total = mooncake.ideal_hit_tokens(records, tokens_per_hash, history)
    return hits / total if total else 0.0


if __name__ == "__main__":
    sys.exit(main())
