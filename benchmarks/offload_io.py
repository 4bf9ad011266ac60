"""The storage tier's two costs, side by side in one run on this machine's disk (`--dir`).

1. **Loads against a sequential read.** An engine on the preset computes `--prompts` prompts of `--prompt-len`
   tokens with the tier on, which writes their blocks behind (every group: full attention, sliding windows, the
   Mamba states the retention policy keeps). Then, per round, alternated: (a) every block file read sequentially
   with plain `read()`s, one after another, into memory; (b) the same files through the tier's own loads (its reader
   process reads them and checks header and checksum, its loader copies the pages into the blocks), as storage hits
   load them. Before each the files are dropped from the page cache (`posix_fadvise(DONTNEED)`; on a guest the host
   may still cache them). `load_ratio` = (a)'s time / (b)'s time, median of the rounds: the share of a plain read's
   speed the loads keep.
2. **Write-behind against the step.** The same decode-heavy workload (`--requests` requests, 256-token prompts
   sharing a prefix, 64 output tokens, all at once) through the engine with the tier off and on, alternated; per
   request the gaps between its tokens (in-process, the time from one step's end to the next's). `p99_itl_ratio` =
   p99 ITL with the tier on over off, median of the rounds; `decode_time_ratio` = the time from the first token out
   to the last, on over off, median of the rounds (every step's cost, where the p99 looks at a few gaps). The engine
   runs here with the GIL switch interval of a served engine process (0.5 ms, `engine_process.GIL_SWITCH_INTERVAL_S`):
   the tier's threads share its GIL (its writer and reader processes do not).
3. **Loads beside decodes.** A fresh engine on the same directory serves storage hits one at a time: each of the
   `--prompts` prompts with its last 16 tokens new, so all blocks before them are read from storage. Per round, alternated:
   with the engine otherwise idle, and beside `--beside` requests decoding. Per hit the time its read took (the
   tier's own histogram) and the time to its first token. `load_beside_decodes_ratio` = mean read time beside the
   decodes over idle, median of the rounds: what the engine's work does to a read (a read on a thread of the
   engine's process waits for its GIL).

Last line: JSON with `load_ratio`, `p99_itl_ratio`, `decode_time_ratio`, the raw figures (`seq_read_gbps`,
`tier_load_gbps`, MB per round, p99 ITL ms and decode seconds on and off, `load_ms_idle`, `load_ms_beside` and the
first tokens' `hit_ttft_ms_*`), the tier's counters, the CPU model and the date. Goals: `load_ratio` >= 0.7,
`p99_itl_ratio` <= 1.1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from hybridpd.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridpd.engine.dtype_choice import this_cpus_model
from hybridpd.engine.engine import LLMEngine
from hybridpd.engine.kv_offload.layout import members, parse_block_name
from hybridpd.engine.kv_offload.store import OffloadStore
from hybridpd.engine.kv_offload.tier import LoadItem, OffloadTier
from hybridpd.engine.request import EngineRequest
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.presets.checkpoints import default_model_dir
from hybridpd.server.engine_process import GIL_SWITCH_INTERVAL_S


def make_engine(model_dir: Path, offload: Path | None) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model_dir=model_dir, threads=1,
        cache=CacheConfig(block_size=16, kv_cache_memory=1 << 30, kv_offload_dir=offload, kv_offload_size=8 << 30),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048),
    ))


def prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def run(engine: LLMEngine, prompts: list[tuple[int, ...]], max_tokens: int) -> dict[str, list[float]]:
    """Every request at once; per request the times its tokens came out."""
    for i, ids in enumerate(prompts):
        engine.add_request(EngineRequest(request_id=f"r{time.monotonic_ns()}-{i}", prompt_token_ids=ids,
                                         sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                 ignore_eos=True)))
    times: dict[str, list[float]] = {}
    while engine.has_work():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            times.setdefault(out.request_id, []).append(now)
    return times


def decode_s(times: dict[str, list[float]]) -> float:
    """From the first token out to the last."""
    return max(t[-1] for t in times.values()) - min(t[0] for t in times.values())


def p99_itl_ms(times: dict[str, list[float]]) -> float:
    gaps = sorted(b - a for t in times.values() for a, b in zip(t, t[1:]))
    return 1000 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]


def drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_read(paths: list[Path]) -> float:
    drop_cache(paths)
    start = time.perf_counter()
    for path in paths:
        with path.open("rb") as f:
            f.read()
    return time.perf_counter() - start


def tier_load(engine: LLMEngine, root: Path, paths: list[Path]) -> float:
    """Every file (every page in it) through a fresh tier's loader, into scratch pages shaped like the engine's."""
    written = engine.offload.store
    store = OffloadStore(root, written.model_key, written.groups, 8 << 30)
    items, rows = [], [0] * len(written.groups)
    for path in paths:
        parsed = parse_block_name(path.name, (1 << len(written.groups)) - 1)
        assert parsed is not None, path
        block_hash, groups = parsed
        for g in members(groups):
            items.append(LoadItem(g, rows[g], block_hash))
            rows[g] += 1
    pages = [torch.zeros(max(1, n), layout.page_bytes, dtype=torch.int8) for n, layout in zip(rows, written.groups)]
    tier = OffloadTier(store, pages, rescan_s=3600)
    first = [item for item in items if item.block_hash == items[0].block_hash]
    wait_for(tier, "warm-up", first)   # its reader process is up, as a node's is long before its first hit
    drop_cache(paths)
    start = time.perf_counter()
    wait_for(tier, "bench", items)
    elapsed = time.perf_counter() - start
    tier.close()
    return elapsed


def wait_for(tier: OffloadTier, request_id: str, items: list[LoadItem]) -> None:
    tier.start_load(request_id, items)
    done = []
    while not done:
        tier.wait_for_load(0.01)
        done = tier.take_finished()
    assert done == [(request_id, True)], done


def hits_beside(engine: LLMEngine, prompts: list[tuple[int, ...]], beside: int, round_: int) -> tuple[float, float]:
    """Mean read time and mean time to first token (ms) of storage hits asked one at a time, beside `beside`
    requests decoding (they end with the hits)."""
    engine.kv.reset_prefix_cache()   # the hits come from storage, not from memory
    background = [f"bg{round_}-{i}" for i in range(beside)]
    for i, request_id in enumerate(background):
        engine.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompt(5000 + i, 32),
                                         sampling=SamplingParams(max_tokens=1_000, temperature=0.0, ignore_eos=True)))
    for _ in range(3):
        engine.step()
    before = engine.offload.snapshot().load_seconds
    ttft = []
    for i, ids in enumerate(prompts):
        request_id = f"hit{round_}-{i}"
        engine.add_request(EngineRequest(request_id=request_id, prompt_token_ids=ids[:-16] + prompt(9000 + i, 16),
                                         sampling=SamplingParams(max_tokens=1, temperature=0.0)))
        start = time.perf_counter()
        while not any(out.request_id == request_id for out in engine.step()):
            pass
        ttft.append(time.perf_counter() - start)
    after = engine.offload.snapshot().load_seconds
    for request_id in background:
        engine.abort(request_id)
    while engine.has_work():
        engine.step()
    assert after.count - before.count == len(prompts), "every hit is read from storage"
    return 1000 * (after.total - before.total) / len(prompts), 1000 * statistics.mean(ttft)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--beside", type=int, default=8, help="requests decoding beside the storage hits")
    parser.add_argument("--dir", type=Path, default=None, help="where the tier writes (default: a temporary "
                        "directory on the disk /tmp is on)")
    args = parser.parse_args()
    if args.dir is not None and not args.dir.is_dir():
        parser.error(f"--dir {args.dir}: no such directory")
    torch.set_num_threads(1)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)   # as a served engine process runs: the tier's threads share its GIL
    model_dir = default_model_dir(args.preset)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp) / "kv"
        writer = make_engine(model_dir, root)
        run(writer, [prompt(100 + i, args.prompt_len) for i in range(args.prompts)], 1)
        writer.close()
        counters = writer.offload.snapshot()
        paths = sorted(writer.offload.store.folder.rglob("*.kv"))
        total_mb = sum(p.stat().st_size for p in paths) / 1e6
        print(f"{len(paths)} block files, {total_mb:.1f} MB", flush=True)

        seq_times, tier_times = [], []
        for r in range(args.rounds):
            seq_times.append(sequential_read(paths))
            tier_times.append(tier_load(writer, root, paths))
            print(f"round {r}: sequential {seq_times[-1]:.3f} s, tier {tier_times[-1]:.3f} s", flush=True)

        shared = prompt(7, 192)
        workload = [shared + prompt(200 + i, 64) for i in range(args.requests)]
        itl: dict[str, list[float]] = {"off": [], "on": []}
        decode: dict[str, list[float]] = {"off": [], "on": []}
        engines = {"off": make_engine(model_dir, None), "on": make_engine(model_dir, Path(tmp) / "itl")}
        run(engines["off"], workload[:2], 4)   # warm both up
        run(engines["on"], workload[:2], 4)
        for r in range(args.rounds):
            for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
                engines[name].kv.reset_prefix_cache()
                fresh = [prompt(1000 * r + i, 8) + ids for i, ids in enumerate(workload)]  # new blocks to write
                times = run(engines[name], fresh, 64)
                itl[name].append(p99_itl_ms(times))
                decode[name].append(decode_s(times))
            print(f"round {r}: p99 ITL off {itl['off'][-1]:.1f} ms, on {itl['on'][-1]:.1f} ms; decode off "
                  f"{decode['off'][-1]:.3f} s, on {decode['on'][-1]:.3f} s", flush=True)
        engines["on"].close()
        written_on = engines["on"].offload.snapshot()

        hits = make_engine(model_dir, root)
        hit_prompts = [prompt(100 + i, args.prompt_len) for i in range(args.prompts)]
        hits_beside(hits, hit_prompts[:1], 0, -1)   # warm-up
        loads: dict[str, list[float]] = {"idle": [], "beside": []}
        hit_ttft: dict[str, list[float]] = {"idle": [], "beside": []}
        for r in range(args.rounds):
            for name in ("idle", "beside") if r % 2 == 0 else ("beside", "idle"):
                load_ms, ttft_ms = hits_beside(hits, hit_prompts, args.beside if name == "beside" else 0, r)
                loads[name].append(load_ms)
                hit_ttft[name].append(ttft_ms)
            print(f"round {r}: a hit's read idle {loads['idle'][-1]:.1f} ms, beside {args.beside} decodes "
                  f"{loads['beside'][-1]:.1f} ms; its first token {hit_ttft['idle'][-1]:.1f} / "
                  f"{hit_ttft['beside'][-1]:.1f} ms", flush=True)
        hits.close()

    seq, load = statistics.median(seq_times), statistics.median(tier_times)
    print(json.dumps({
        "load_ratio": round(seq / load, 3),
        "p99_itl_ratio": round(statistics.median(on / off for on, off in zip(itl["on"], itl["off"])), 3),
        "decode_time_ratio": round(statistics.median(on / off for on, off in zip(decode["on"], decode["off"])), 3),
        "load_beside_decodes_ratio": round(statistics.median(b / i for b, i in zip(loads["beside"], loads["idle"])),
                                           3),
        "load_ms_idle": [round(x, 2) for x in loads["idle"]], "load_ms_beside": [round(x, 2) for x in loads["beside"]],
        "hit_ttft_ms_idle": [round(x, 2) for x in hit_ttft["idle"]],
        "hit_ttft_ms_beside": [round(x, 2) for x in hit_ttft["beside"]],
        "seq_read_gbps": round(total_mb / 1e3 / seq, 3), "tier_load_gbps": round(total_mb / 1e3 / load, 3),
        "mb_per_round": round(total_mb, 1), "files": len(paths),
        "p99_itl_ms_off": [round(x, 2) for x in itl["off"]], "p99_itl_ms_on": [round(x, 2) for x in itl["on"]],
        "decode_s_off": [round(x, 3) for x in decode["off"]], "decode_s_on": [round(x, 3) for x in decode["on"]],
        "writer_counters": dataclasses.asdict(counters), "itl_tier_counters": dataclasses.asdict(written_on),
        "beside": args.beside, "preset": args.preset, "cpu": this_cpus_model(), "date": time.strftime("%Y-%m-%d"),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
