"""A slice of the Mooncake conversation trace through a 2 prefill + 2 decode cluster: round robin with memory only,
against cache_aware routing with the storage tier (every node on one shared `--kv-offload-dir`).

The slice (`--trace-start`, `--trace-duration`, `--max-requests` of `../shared/traces/mooncake_conversation_trace.
jsonl`, `--tokens-per-hash` tokens per hash id, arrival times times `--time-scale`, outputs capped at `--max-tokens`)
is replayed with the token synthesis of `hybridpd bench --dataset-name mooncake_trace` (equal hash ids, equal
blocks): each request is sent at its arrival time through the proxy, streamed, greedy. Each setup gets a fresh
cluster (and the tier a fresh directory) per round; setups alternate. Per setup: the decode-side hit rate (the
decode nodes' usage.prompt_tokens_details.cached_tokens over prompt tokens: memory, and storage when on), mean and
p90 TTFT at the client, and each request's token ids, compared across setups.

Last line: JSON with `hit_rate_over_ideal` (the tier's decode-side hit rate over the slice's ideal, an unbounded
cache's; goal >= 0.9), `mean_ttft_ratio` (tier / round robin; goal <= 0.6), `outputs_identical`, the raw figures
per setup and round, the tier's counters, the CPU model and the date.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from hybridpd.bench import mooncake
from hybridpd.engine.model.loader import read_model_config
from hybridpd.launcher.cluster import LocalCluster
from hybridpd.launcher.ports import free_cluster_ports
from hybridpd.launcher.spec import ClusterSpec
from hybridpd.presets.checkpoints import default_model_dir

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
                      delay: float) -> dict[str, Any]:
    await asyncio.sleep(delay)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    start = time.perf_counter()
    ttft, usage, ids = None, None, []
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.read())[:300]!r}")
        async for line in response.content:
            text = line.decode().strip()
            if not text.startswith("data: ") or text == "data: [DONE]":
                continue
            event = json.loads(text[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            for choice in event.get("choices") or ():
                if ttft is None:
                    ttft = time.perf_counter() - start
                ids.extend(choice.get("token_ids") or ())
            if event.get("usage"):
                usage = event["usage"]
    return {"ttft": ttft, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "token_ids": ids}


async def replay(url: str, prompts: list[list[int]], offsets: list[float], max_tokens: int) -> list[dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        return await asyncio.gather(*(one_request(session, url, p, max_tokens, t) for p, t in zip(prompts, offsets)))


def tier_counters(metrics_urls: list[str]) -> dict[str, float]:
    import urllib.request
    totals: dict[str, float] = {}
    for url in metrics_urls:
        with urllib.request.urlopen(url, timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("hybridpd:kv_offload_") and not line.startswith("#"):
                    name = line.split("{")[0].split(" ")[0]
                    totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def run_setup(name: str, args: argparse.Namespace, prompts: list[list[int]], offsets: list[float],
              offload_root: Path) -> dict[str, Any]:
    proxy_port, base_port = free_cluster_ports(4, kv_events=True)
    tier = ("--kv-offload-dir", str(offload_root), "--kv-offload-size", "4GiB") if name == "tier" else ()
    spec = ClusterSpec(
        num_prefill=2, num_decode=2, model_dir=default_model_dir(args.preset), port=proxy_port, base_port=base_port,
        kv_events=name == "tier",
        serve_args=("--kv-cache-memory", args.kv_cache_memory, "--max-model-len", str(args.max_model_len), *tier),
        proxy_args=("--routing", "cache_aware" if name == "tier" else "round_robin", "--prefill-timeout", "1200",
                    "--decode-timeout", "1200"),
    )
    with LocalCluster(spec) as info:
        results = asyncio.run(replay(info.proxy_url, prompts, offsets, args.max_tokens))
        counters = tier_counters([n.metrics_url for n in (*info.prefill, *info.decode)]) if tier else {}
    ttfts = [r["ttft"] for r in results]
    return {
        "decode_hit_rate": sum(r["cached_tokens"] for r in results) / sum(r["prompt_tokens"] for r in results),
        "mean_ttft_ms": statistics.mean(ttfts) * 1e3, "p90_ttft_ms": statistics.quantiles(ttfts, n=10)[-1] * 1e3,
        "token_ids": [r["token_ids"] for r in results], "tier": counters,
    }


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


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
    args = parser.parse_args()

    trace = mooncake.TraceSlice(tokens_per_hash=args.tokens_per_hash, time_scale=args.time_scale,
                                start_s=args.trace_start, duration_s=args.trace_duration,
                                max_requests=args.max_requests, max_output_len=args.max_tokens)
    records = [r for r in mooncake.select(mooncake.read_trace(args.trace), trace)
               if mooncake.scaled_length(r, args.tokens_per_hash) < args.max_model_len - args.max_tokens]
    vocab = read_model_config(default_model_dir(args.preset))[0].vocab_size
    rng = np.random.Generator(np.random.PCG64(0))
    prompts = [list(mooncake.prompt_tokens(r, args.tokens_per_hash, vocab, rng)) for r in records]
    offsets = mooncake.arrival_offsets(records, trace)
    hits, total = mooncake.ideal_hit_tokens(records, args.tokens_per_hash)
    ideal = hits / total
    print(f"{len(prompts)} requests over {offsets[-1]:.0f} s, {total} prompt tokens, ideal hit rate {ideal:.3f}",
          flush=True)

    runs: dict[str, list[dict[str, Any]]] = {"round_robin": [], "tier": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in ("round_robin", "tier") if r % 2 == 0 else ("tier", "round_robin"):
                runs[name].append(run_setup(name, args, prompts, offsets, Path(tmp) / f"kv-{r}"))
                last = runs[name][-1]
                print(f"round {r} {name}: decode hit rate {last['decode_hit_rate']:.3f}, mean TTFT "
                      f"{last['mean_ttft_ms']:.0f} ms, p90 {last['p90_ttft_ms']:.0f} ms", flush=True)

    def mean(name: str, key: str) -> float:
        return statistics.mean(run[key] for run in runs[name])

    outputs = [run["token_ids"] for runs_of in runs.values() for run in runs_of]
    print(json.dumps({
        "hit_rate_over_ideal": round(mean("tier", "decode_hit_rate") / ideal, 3),
        "mean_ttft_ratio": round(mean("tier", "mean_ttft_ms") / mean("round_robin", "mean_ttft_ms"), 3),
        "outputs_identical": all(o == outputs[0] for o in outputs),
        "ideal_hit_rate": round(ideal, 4), "requests": len(prompts), "prompt_tokens": total,
        "setups": {name: [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in run.items() if k != "token_ids"}
                          for run in runs_of] for name, runs_of in runs.items()},
        "slice": vars(args) | {"trace": str(args.trace)}, "cpu": cpu_model(), "date": time.strftime("%Y-%m-%d"),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
