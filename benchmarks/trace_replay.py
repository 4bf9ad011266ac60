"""A slice of the Mooncake conversation trace through a 2 prefill + 2 decode cluster: round robin with memory only,
against cache_aware routing with the storage tier (every node on one shared `--kv-offload-dir`), and cache_aware
without it (what the tier adds to the routing).

The slice (`--trace-start`, `--trace-duration`, `--max-requests` of `../shared/traces/mooncake_conversation_trace.
jsonl`, `--tokens-per-hash` tokens per hash id, arrival times times `--time-scale`, outputs capped at `--max-tokens`)
is replayed with the token synthesis of `hybridpd bench --dataset-name mooncake_trace` (equal hash ids, equal
blocks): each request is sent at its arrival time through the proxy, streamed, greedy. Each setup gets a fresh
cluster (and the tier a fresh directory) per round; setups alternate. Per setup: the decode-side hit rate (the
decode nodes' usage.prompt_tokens_details.cached_tokens over prompt tokens: memory, and storage when on), mean and
p90 TTFT at the client, and each request's token ids, compared across setups.

The trace's prefixes come back minutes later, so a slice replayed on empty caches sees little of its reuse: with
`--history S` each cluster first serves the S seconds of trace before the slice (at `--history-time-scale` of their
times, unmeasured; with the tier, until its writers have stored what they were given), then the slice; the ideal hit
rate counts the history as seen, and every figure (CPU, the nodes' counters) is the slice's.

Last line: JSON with `hit_rate_over_ideal` (the tier's decode-side hit rate over the slice's ideal, an unbounded
cache's; goal >= 0.9), `mean_ttft_ratio` (tier / round robin; goal <= 0.6), `outputs_identical`, the raw figures
per setup and round, the tier's counters (summed over the nodes, per label: the CPU of each of its threads among
them), each role's CPU over the slice (`cpu_s`) and by thread (`cpu_s_by_thread`: "decode/engine" is the decode
nodes' engine threads, "prefill/kv-writer" and "prefill/kv-reader" their storage tier's processes, "decode/python"
their fronts), the CPU model and the date.

With `--restart-at S` it runs the tier setup alone and SIGKILLs every node S seconds into the replay (the
supervisor restarts them, as `hybridpd up` does); requests that fail meanwhile are counted, not retried. Last line:
`restart_hit_ratio`, the decode-side hit rate of the requests sent in the minute after every node answers /health
again over the minute before the kill (goal >= 0.8). Then the same replay again without the kill, as a control:
`restart_hit_ratio_vs_control` is the minute after against the same minute of the control (the slice's own reuse
changes with time, so the minute before alone does not say what the restart cost).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from hybridpd.bench import mooncake
from hybridpd.engine.dtype_choice import this_cpus_model
from hybridpd.engine.model.loader import read_model_config
from hybridpd.launcher.cluster import LocalCluster
from hybridpd.launcher.ports import free_cluster_ports
from hybridpd.launcher.spec import ClusterSpec
from hybridpd.launcher.supervisor import RestartPolicy, Supervisor
from hybridpd.presets.checkpoints import default_model_dir
from routing import one_request   # benchmarks/routing.py: one streamed greedy completion

SETUPS = ("round_robin", "cache_aware", "tier")   # the last: cache_aware with the storage tier
TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


@dataclass(frozen=True)
class Workload:
    """Trace records, their prompts, and the seconds after the start at which each is sent."""
    records: list[mooncake.TraceRecord]
    prompts: list[list[int]]
    offsets: list[float]


async def timed_request(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
                        delay: float, tolerate_errors: bool = False) -> dict[str, Any]:
    await asyncio.sleep(delay)
    try:
        return await one_request(session, url, prompt, max_tokens) | {"sent_at": delay}
    except (RuntimeError, aiohttp.ClientError, KeyError, TypeError) as exc:
        if not tolerate_errors:
            raise
        return {"sent_at": delay, "error": str(exc)[:200]}


async def replay(url: str, prompts: list[list[int]], offsets: list[float], max_tokens: int,
                 tolerate_errors: bool = False) -> list[dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        return await asyncio.gather(*(timed_request(session, url, p, max_tokens, t, tolerate_errors)
                                      for p, t in zip(prompts, offsets)))


def crash_and_restart(cluster: LocalCluster, info: Any, at: float, started: float, back: list[float],
                      replayed: threading.Event) -> None:
    """At `at` s into the replay SIGKILL every node; the supervisor restarts them; `back` gets the time (s into the
    replay) when every node answers /health again. The thread lives until the replay ends: the restarted nodes die
    with the thread that started them (PR_SET_PDEATHSIG, launcher/process.py)."""
    nodes = [c for c in cluster.children if c.name != "proxy"]
    time.sleep(max(0.0, started + at - time.monotonic()))
    for child in nodes:
        child.kill()
    supervisor = Supervisor([c for c in cluster.children if c.name != "proxy"], RestartPolicy.ON_FAILURE,
                            cluster.respawn, report=lambda line: print(line, flush=True))
    urls = [n.url for n in (*info.prefill, *info.decode)]
    while True:
        supervisor.check()
        if all(_healthy(url) for url in urls):
            back.append(time.monotonic() - started)
            replayed.wait()
            return
        time.sleep(0.2)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def window_hit_rate(results: list[dict], start: float, end: float) -> tuple[float | None, int]:
    """Decode-side hit rate of the requests sent in [start, end) that were answered, and how many there were."""
    done = [r for r in results if start <= r["sent_at"] < end and "error" not in r]
    total = sum(r["prompt_tokens"] for r in done)
    return (sum(r["cached_tokens"] for r in done) / total if total else None), len(done)


def sessions_cpu_s(sessions: set[int]) -> float:
    """CPU seconds (user + system) used so far by the live processes of these sessions (a node's front and engine
    process, the proxy: each child of the cluster leads a session of its own)."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) in sessions:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def threads_cpu_s(roles: dict[str, set[int]]) -> dict[str, float]:
    """CPU seconds used so far by the live threads of each role's sessions, by role and thread name ("decode/engine",
    "prefill/kv-offload-scan", "prefill/kv-writer": the names the nodes give their threads and the tier's processes,
    the kernel's first 15 bytes), summed over the role's nodes."""
    role_of = {session: role for role, sessions in roles.items() for session in sessions}
    tick = os.sysconf("SC_CLK_TCK")
    seconds: dict[str, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            role = role_of.get(int(stat.read_text().rsplit(")", 1)[1].split()[3]))
            if role is None:
                continue
            for task in (stat.parent / "task").iterdir():
                text = (task / "stat").read_text()
                name, fields = text.split("(", 1)[1].rsplit(")", 1)[0], text.rsplit(")", 1)[1].split()
                key = f"{role}/{name}"
                seconds[key] = seconds.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):   # a process or thread that ended meanwhile
            continue
    return seconds


def summed(metrics_urls: list[str], prefix: str, by_label: bool = False) -> dict[str, float]:
    """Every sample whose name starts with `prefix`, summed over the nodes (and over labels, unless `by_label`)."""
    totals: dict[str, float] = {}
    for url in metrics_urls:
        with urllib.request.urlopen(url, timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(prefix):
                    name = line.rsplit(" ", 1)[0] if by_label else line.split("{")[0].split(" ")[0]
                    totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def role_counters(metrics_urls: list[str]) -> dict[str, float]:
    """The counters `role_figures` reads, summed over the nodes."""
    return (summed(metrics_urls, "vllm:prefix_cache_queries")
            | summed(metrics_urls, "vllm:time_to_first_token_seconds_")
            | summed(metrics_urls, "vllm:request_queue_time_seconds_")
            | summed(metrics_urls, "vllm:request_prefill_time_seconds_")
            | summed(metrics_urls, "vllm:prompt_tokens_cached_by_source", by_label=True))


def growth(before: dict[str, float], after: dict[str, float], name: str) -> float:
    """How much a summed sample (`summed`) grew between two reads."""
    return after.get(name, 0.0) - before.get(name, 0.0)


def role_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The nodes' own view between two `role_counters`: their prefix-cache hit rate (memory and storage), mean
    time from a request's arrival at the node to its first token, and its two phases (vLLM's): queued (to the
    engine's first scheduling of it) and prefill (from there to its first token: a storage read's wait included)."""
    def grown(name: str) -> float:
        return growth(before, after, name)
    queries, count = grown("vllm:prefix_cache_queries_total"), grown("vllm:time_to_first_token_seconds_count")
    hits = sum(grown(name) for name in after if name.startswith("vllm:prompt_tokens_cached_by_source_total")
               and any(f'source="{source}"' in name for source in ("device", "disk")))
    return {"hit_rate": hits / queries if queries else 0.0,
            "node_mean_ttft_ms": grown("vllm:time_to_first_token_seconds_sum") / count * 1e3 if count else 0.0,
            **{f"node_mean_{phase}_ms": (grown(f"vllm:request_{phase}_time_seconds_sum") * 1e3
                                         / max(grown(f"vllm:request_{phase}_time_seconds_count"), 1))
               for phase in ("queue", "prefill")}}


def alone_figures(before: dict[str, float], after: dict[str, float], alone: float) -> dict[str, float | None]:
    """The decode nodes' own mean TTFT and prefill phase of the requests they served whole (`--pd-threshold`): a
    remotely prefilled request's first token is its prefill node's, out at once (TTFT and prefill phase 0 on its
    decode node: the pull is in its second token), so the decode nodes' sums are those requests' alone."""
    return {f"decode_alone_node_mean_{name}_ms": growth(before, after, f"vllm:{metric}_seconds_sum") * 1e3 / alone
            if alone else None
            for name, metric in (("ttft", "time_to_first_token"), ("prefill", "request_prefill_time"))}


def serve_history(info: Any, history: Workload, max_tokens: int, metrics_urls: list[str], tier: bool) -> int:
    """The requests before the slice, served and not measured; then, with the tier, until its writers have
    stored what they were given (its written and dropped counts unchanged for a second). How many failed."""
    results = asyncio.run(replay(info.proxy_url, history.prompts, history.offsets, max_tokens, tolerate_errors=True))
    stored = None
    while tier:
        now = sum(v for name, v in summed(metrics_urls, "hybridpd:kv_offload_").items()
                  if name.startswith(("hybridpd:kv_offload_written", "hybridpd:kv_offload_dropped")))
        if now == stored:
            break
        stored = now
        time.sleep(1.0)
    return sum("error" in r for r in results)


def run_setup(name: str, args: argparse.Namespace, prompts: list[list[int]], offsets: list[float],
              offload_root: Path, restart_at: float | None = None,
              probe: Callable[[Any], Callable[[], Any]] | None = None,
              windows: tuple[tuple[float, float], ...] = (), history: Workload | None = None,
              policy: str = "fcfs") -> dict[str, Any]:
    """`policy`: every node's `--scheduling-policy`. `probe`: called with the cluster's info while it is idle, before
    the replay (after the history); what the function it returns gives after the replay is kept. `windows`: spans of send times whose decode-side hit rates
    are reported. `history`: served first (`serve_history`); every figure is the replay's after it."""
    proxy_port, base_port = free_cluster_ports(4, kv_events=True)
    tier = ("--kv-offload-dir", str(offload_root), "--kv-offload-size", "4GiB") if name == "tier" else ()
    spec = ClusterSpec(
        num_prefill=2, num_decode=2, model_dir=default_model_dir(args.preset), port=proxy_port, base_port=base_port,
        kv_events=name != "round_robin",
        serve_args=("--kv-cache-memory", args.kv_cache_memory, "--max-model-len", str(args.max_model_len), *tier,
                    "--scheduling-policy", policy),
        proxy_args=("--routing", "round_robin" if name == "round_robin" else "cache_aware", "--prefill-timeout",
                    "1200", "--decode-timeout", "1200",
                    *(("--pd-threshold", str(args.pd_threshold)) if name != "round_robin" else ())),
    )
    cluster = LocalCluster(spec)
    with cluster as info:
        back: list[float] = []
        replayed = threading.Event()
        if restart_at is not None:
            crasher = threading.Thread(target=crash_and_restart, args=(cluster, info, restart_at, time.monotonic(),
                                                                        back, replayed), daemon=True)
            crasher.start()
        node_metrics = [n.metrics_url for n in (*info.prefill, *info.decode)]
        prefill_metrics = [n.metrics_url for n in info.prefill]
        history_failed = serve_history(info, history, args.max_tokens, node_metrics, bool(tier)) if history else 0
        after = probe(info) if probe is not None else None
        # each role's CPU over the replay (not with --restart-at: the restarted nodes are other processes)
        roles = {"prefill": {n.pid for n in info.prefill}, "decode": {n.pid for n in info.decode},
                 "proxy": {info.proxy_pid}} if restart_at is None else {}
        cpu_before = {role: sessions_cpu_s(pids) for role, pids in roles.items()}
        threads_before = threads_cpu_s(roles)
        prefill_before = role_counters(prefill_metrics)
        decode_metrics = [n.metrics_url for n in info.decode]
        decode_before = role_counters(decode_metrics)
        tier_before = summed(node_metrics, "hybridpd:kv_offload_", by_label=True) if tier else {}
        proxy_before = summed([info.proxy_url + "/metrics"], "hybridpd_proxy_", by_label=True)
        results = asyncio.run(replay(info.proxy_url, prompts, offsets, args.max_tokens, restart_at is not None))
        cpu_s = {role: round(sessions_cpu_s(pids) - cpu_before[role], 2) for role, pids in roles.items()}
        threads_after = threads_cpu_s(roles)
        by_thread = {key: round(after - threads_before.get(key, 0.0), 2) for key, after in threads_after.items()}
        probed = after() if after is not None else None
        counters = {label: value - tier_before.get(label, 0.0) for label, value in
                    summed(node_metrics, "hybridpd:kv_offload_", by_label=True).items()} if tier else {}
        prefill_side = role_figures(prefill_before, role_counters(prefill_metrics))
        decode_after = role_counters(decode_metrics)
        proxy_after = summed([info.proxy_url + "/metrics"], "hybridpd_proxy_", by_label=True)
        alone = growth(proxy_before, proxy_after, "hybridpd_proxy_decode_alone_total")
        predictions = {name: growth(proxy_before, proxy_after, name) for name in proxy_after
                       if "hit" in name and "_created" not in name}
        replayed.set()
    if restart_at is not None:
        before = window_hit_rate(results, restart_at - 60, restart_at)
        after = window_hit_rate(results, back[0], back[0] + 60) if back else (None, 0)
        return {"restart_at_s": restart_at, "back_at_s": back[0] if back else None,
                "hit_rate_minute_before": before[0], "requests_before": before[1],
                "hit_rate_minute_after": after[0], "requests_after": after[1],
                "failed_requests": sum("error" in r for r in results), "tier": counters}
    ttfts = [r["ttft"] for r in results]
    return {
        "decode_hit_rate": sum(r["cached_tokens"] for r in results) / sum(r["prompt_tokens"] for r in results),
        "mean_ttft_ms": statistics.mean(ttfts) * 1e3, "p90_ttft_ms": statistics.quantiles(ttfts, n=10)[-1] * 1e3,
        "cpu_s": cpu_s,
        "cpu_s_by_thread": dict(sorted(((key, s) for key, s in by_thread.items() if s >= 0.01), key=lambda kv: -kv[1])),
        "prefill_hit_rate": prefill_side["hit_rate"],
        "decode_alone_requests": alone, "predictions": predictions,
        **alone_figures(decode_before, decode_after, alone),
        "prefill_node_mean_ttft_ms": prefill_side["node_mean_ttft_ms"],
        "prefill_node_mean_queue_ms": prefill_side["node_mean_queue_ms"],
        "prefill_node_mean_prefill_ms": prefill_side["node_mean_prefill_ms"],
        "token_ids": [r["token_ids"] for r in results], "tier": counters, "probe": probed,
        "window_hit_rates": [window_hit_rate(results, start, end)[0] for start, end in windows],
        "history_failed": history_failed,
    }


def load_slice(args: argparse.Namespace) -> tuple[mooncake.TraceSlice, list[mooncake.TraceRecord], list[list[int]],
                                                  list[float]]:
    """The slice the flags name (prompts that leave room for `--max-tokens` under `--max-model-len`), its prompts
    as `hybridpd bench` synthesizes them, and their arrival times."""
    trace = mooncake.TraceSlice(tokens_per_hash=args.tokens_per_hash, time_scale=args.time_scale,
                                start_s=args.trace_start, duration_s=args.trace_duration,
                                max_requests=args.max_requests, max_output_len=args.max_tokens)
    records = _fitting(args, mooncake.select(mooncake.read_trace(args.trace), trace))
    return trace, records, _prompts(args, records, seed=0), mooncake.arrival_offsets(records, trace)


def load_history(args: argparse.Namespace) -> Workload | None:
    """The `--history` seconds of trace before the slice (the same length filter), sent at their trace times times
    `--history-time-scale`; prompts from a stream of their own, so the slice's prompts are the same with or without."""
    if not args.history:
        return None
    start = mooncake.TraceSlice(tokens_per_hash=args.tokens_per_hash, start_s=args.trace_start)
    records = _fitting(args, mooncake.history(mooncake.read_trace(args.trace), start, args.history))
    first = mooncake.TraceSlice(start_s=records[0].timestamp_ms / 1000 if records else 0.0,
                                time_scale=args.history_time_scale)
    return Workload(records, _prompts(args, records, seed=1), mooncake.arrival_offsets(records, first))


def _fitting(args: argparse.Namespace, records: list[mooncake.TraceRecord]) -> list[mooncake.TraceRecord]:
    """The records whose prompts leave room for `--max-tokens` under `--max-model-len`."""
    return [r for r in records
            if mooncake.scaled_length(r, args.tokens_per_hash) < args.max_model_len - args.max_tokens]


def _prompts(args: argparse.Namespace, records: list[mooncake.TraceRecord], seed: int) -> list[list[int]]:
    """The records' prompts as `hybridpd bench` synthesizes them (each one's own tail from the stream `seed`)."""
    vocab = read_model_config(default_model_dir(args.preset))[0].vocab_size
    rng = np.random.Generator(np.random.PCG64(seed))
    return [list(mooncake.prompt_tokens(r, args.tokens_per_hash, vocab, rng)) for r in records]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--tokens-per-hash", type=int, default=16)
    parser.add_argument("--trace-start", type=float, default=0.0)
    parser.add_argument("--trace-duration", type=float, default=300.0)
    parser.add_argument("--max-requests", type=int, default=240)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--kv-cache-memory", default="48MiB")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--pd-threshold", type=int, default=0, metavar="TOKENS",
                        help="the proxy's --pd-threshold in the cache_aware setups (a request its decode node would "
                             "compute fewer prompt tokens of is served whole there); 0: always disaggregate")
    parser.add_argument("--scheduling-policies", nargs="+", choices=("fcfs", "sjf"), default=["fcfs"],
                        help="every setup under each of these nodes' --scheduling-policy, alternated (the ratios "
                             "are each policy's own; a setup under sjf is named with /sjf)")
    parser.add_argument("--offload-root", type=Path, default=None,
                        help="where the tier's directory is made (default: the system's temporary directory)")
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS),
                        help="which setups to run (the ratios need round_robin and tier)")
    parser.add_argument("--restart-at", type=float, default=None, metavar="S",
                        help="instead: the tier setup alone, every node SIGKILLed S seconds into the replay and "
                             "restarted by the supervisor; the decode-side hit rate of the minute after they are back "
                             "against the minute before")
    parser.add_argument("--history", type=float, default=0.0, metavar="S",
                        help="first serve the S seconds of trace before --trace-start, unmeasured, on every setup: "
                             "caches as a cluster that has been serving holds them (the trace's prefixes come back "
                             "minutes later); the ideal hit rate counts them as seen")
    parser.add_argument("--history-time-scale", type=float, default=0.25,
                        help="the history's arrival times times this (default: 0.25, four times as fast)")
    args = parser.parse_args()
    if args.history and args.restart_at is not None:
        parser.error("--history and --restart-at exclude each other")
    if args.history < 0 or not args.history_time_scale > 0:
        parser.error("--history must be >= 0 and --history-time-scale positive")
    if args.offload_root is not None and not args.offload_root.is_dir():
        parser.error(f"--offload-root {args.offload_root}: no such directory")

    _, records, prompts, offsets = load_slice(args)
    history = load_history(args)
    hits, total = mooncake.ideal_hit_tokens(records, args.tokens_per_hash, history.records if history else ())
    ideal = hits / total
    print(f"{len(prompts)} requests over {offsets[-1]:.0f} s, {total} prompt tokens, ideal hit rate {ideal:.3f}"
          + (f", after {len(history.prompts)} requests of history over {history.offsets[-1]:.0f} s" if history else ""),
          flush=True)

    slice_info = vars(args) | {"trace": str(args.trace),
                               "offload_root": str(args.offload_root or tempfile.gettempdir())}
    if args.restart_at is not None:
        with tempfile.TemporaryDirectory(dir=args.offload_root) as tmp:
            result = run_setup("tier", args, prompts, offsets, Path(tmp) / "kv", restart_at=args.restart_at)
            # the control (module docstring): the same replay without the restart, over the same two minutes
            back = result["back_at_s"] if result["back_at_s"] is not None else args.restart_at
            control = run_setup("tier", args, prompts, offsets, Path(tmp) / "kv-control",
                                windows=((args.restart_at - 60, args.restart_at), (back, back + 60)))
        before, after = result["hit_rate_minute_before"], result["hit_rate_minute_after"]
        control_before, control_after = control["window_hit_rates"]
        print(json.dumps({"restart_hit_ratio": round(after / before, 3) if before and after is not None else None,
                          "restart_hit_ratio_vs_control": (round(after / control_after, 3)
                                                           if control_after and after is not None else None),
                          **result, "control_hit_rate_minute_before": control_before,
                          "control_hit_rate_minute_after": control_after, "ideal_hit_rate": round(ideal, 4),
                          "slice": slice_info, "cpu": this_cpus_model(), "date": time.strftime("%Y-%m-%d")}))
        return 0

    setups = [(name, policy) for policy in dict.fromkeys(args.scheduling_policies) for name in SETUPS
              if name in args.setups]
    runs: dict[str, list[dict[str, Any]]] = {_named(*setup): [] for setup in setups}
    with tempfile.TemporaryDirectory(dir=args.offload_root) as tmp:
        for r in range(args.rounds):
            for name, policy in setups if r % 2 == 0 else setups[::-1]:
                directory = Path(tmp) / f"kv-{r}-{policy}"   # a fresh one per tier setup
                runs[_named(name, policy)].append(run_setup(name, args, prompts, offsets, directory,
                                                            history=history, policy=policy))
                last = runs[_named(name, policy)][-1]
                print(f"round {r} {_named(name, policy)}: decode hit rate {last['decode_hit_rate']:.3f}, prefill hit "
                      f"rate {last['prefill_hit_rate']:.3f}, mean TTFT {last['mean_ttft_ms']:.0f} ms (on the prefill node "
                      f"{last['prefill_node_mean_ttft_ms']:.0f}: queued {last['prefill_node_mean_queue_ms']:.0f}, "
                      f"prefill {last['prefill_node_mean_prefill_ms']:.0f}), p90 {last['p90_ttft_ms']:.0f} ms, "
                      f"CPU s {last['cpu_s']}, served by a decode node alone {last['decode_alone_requests']:.0f}",
                      flush=True)

    def mean(name: str, key: str) -> float | None:
        return statistics.mean(run[key] for run in runs[name]) if runs.get(name) else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    outputs = [run["token_ids"] for runs_of in runs.values() for run in runs_of]
    first = args.scheduling_policies[0]
    print(json.dumps({
        "hit_rate_over_ideal": ratio(mean(_named("tier", first), "decode_hit_rate"), ideal),
        "mean_ttft_ratio": ratio(mean(_named("tier", first), "mean_ttft_ms"),
                                 mean(_named("round_robin", first), "mean_ttft_ms")),
        "tier_over_cache_aware_ttft": ratio(mean(_named("tier", first), "mean_ttft_ms"),
                                            mean(_named("cache_aware", first), "mean_ttft_ms")),
        # each later policy: the tier under it against round robin under it, and against round robin under the first
        **{f"mean_ttft_ratio_{policy}": ratio(mean(_named("tier", policy), "mean_ttft_ms"),
                                              mean(_named("round_robin", policy), "mean_ttft_ms"))
           for policy in args.scheduling_policies[1:]},
        **{f"mean_ttft_ratio_{policy}_vs_{first}_round_robin": ratio(mean(_named("tier", policy), "mean_ttft_ms"),
                                                                     mean(_named("round_robin", first), "mean_ttft_ms"))
           for policy in args.scheduling_policies[1:]},
        "outputs_identical": all(o == outputs[0] for o in outputs),
        "ideal_hit_rate": round(ideal, 4), "requests": len(prompts), "prompt_tokens": total,
        "history_requests": len(history.prompts) if history else 0,
        "setups": {name: [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in run.items() if k != "token_ids"}
                          for run in runs_of] for name, runs_of in runs.items()},
        "slice": slice_info, "cpu": this_cpus_model(), "date": time.strftime("%Y-%m-%d"),
    }))
    return 0


def _named(setup: str, policy: str) -> str:
    """A setup's name in the figures: under fcfs its own, under another policy with it (`tier/sjf`)."""
    return setup if policy == "fcfs" else f"{setup}/{policy}"


if __name__ == "__main__":
    raise SystemExit(main())
