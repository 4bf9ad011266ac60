"""What a scan of the storage tier's directory costs a node while another node keeps writing into it.

A directory of `--files` block files of one group (the store's own layout: 256 shard folders; content hashes, so
the files spread over all of them) is scanned by one
store while another store (another node sharing the directory) writes `--changes` new files between two scans and
evicts old ones to stay within a capacity of `--files` files (a tenth at a time), as a busy cluster does between
the tier's scans (the trace replay wrote ~1,000 files per node per 5 s). Per round, alternated: the store's
`scan()` between its full listings (it reads what the other store journaled since its last scan), and a plain
scan that lists every folder and parses every name (what a full listing costs). Both are timed in CPU seconds of
this thread, the median of `--scans` scans per round, and each must find exactly what a listing finds.

Then what a full listing costs the engine's steps beside it (the scanner is a thread of the engine's process): an
engine on the small preset (one thread, the GIL switch interval of the engine's process) decodes `--decodes`
requests, and its step times are taken while another thread lists the directory again and again, at once or paced
(the tier's scanner: store.py's module docstring), or while nothing else runs; the three alternated, `--steps` steps
each a round.

Last line: JSON with `scan_ms` and `full_listing_ms` (medians over the rounds), their ratio, the files and changes;
`step_ms` (p50, p99 and max of the steps, pooled over the rounds, per way: "alone", "listing_at_once", "paced"),
`step_p99_ratio_at_once` and `step_p99_ratio_paced` (over alone), `listing_wall_ms` per way; the CPU model and the
date.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from hybridpd.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridpd.engine.dtype_choice import this_cpus_model
from hybridpd.engine.engine import LLMEngine
from hybridpd.engine.kv_offload.layout import GroupLayout
from hybridpd.engine.kv_offload.store import OffloadStore
from hybridpd.engine.request import EngineRequest
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.gc_heap import freeze_startup_heap
from hybridpd.presets.checkpoints import default_model_dir
from hybridpd.server.engine_process import GIL_SWITCH_INTERVAL_S

MODEL, GROUP, PAGE = b"m" * 32, b"g" * 16, 64


def full_listing(folder: Path) -> set[bytes]:
    hashes: set[bytes] = set()
    for shard in os.scandir(folder):
        if len(shard.name) != 2:   # the journals' folder
            continue
        for name in os.listdir(shard.path):
            if name.endswith(".kv"):
                hashes.add(bytes.fromhex(name.split(".")[0]))
    return hashes


def decoding_engine(decodes: int) -> LLMEngine:
    """The small preset on one thread with `decodes` requests decoding (long outputs), past their prefill."""
    engine = LLMEngine(EngineConfig(model_dir=default_model_dir(), dtype="float32", threads=1,
                                    cache=CacheConfig(kv_cache_memory=256 << 20),
                                    scheduler=SchedulerConfig(max_num_seqs=decodes, max_model_len=4096)))
    sampling = SamplingParams(max_tokens=3500, temperature=0.0, ignore_eos=True)
    for i in range(decodes):
        engine.add_request(EngineRequest(request_id=f"d{i}", prompt_token_ids=tuple(range(5, 69 + i)),
                                         sampling=sampling))
    for _ in range(3):
        engine.step()
    return engine


def steps_beside(engine: LLMEngine, store: OffloadStore | None, paced: bool, steps: int) -> tuple[list[float], float]:
    """`steps` step times (s) while another thread lists `store`'s directory over and over (`paced` or at once; no
    thread without a store), and the listings' mean wall time (s; 0 without a store)."""
    stop, walls = threading.Event(), []

    def list_again() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            store.scan(full=True, paced=paced)
            walls.append(time.perf_counter() - started)

    lister = threading.Thread(target=list_again) if store is not None else None
    if lister is not None:
        lister.start()
    times = []
    try:
        for _ in range(steps):
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
    finally:
        stop.set()
        if lister is not None:
            lister.join()
    return times, (statistics.mean(walls) if walls else 0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=30_000, help="the directory's size (the writer's capacity)")
    parser.add_argument("--changes", type=int, default=1_000, help="files another writer adds between two scans")
    parser.add_argument("--scans", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decodes", type=int, default=8, help="requests decoding beside the listings")
    parser.add_argument("--steps", type=int, default=300, help="steps timed per way and round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    layout = (GroupLayout(GROUP, PAGE),)
    payload = memoryview(bytes(PAGE))
    counter = iter(range(1 << 62))

    def write(store: OffloadStore, n: int) -> None:
        for _ in range(n):
            store.write(0, hashlib.blake2b(next(counter).to_bytes(8, "little"), digest_size=32).digest(), payload)

    timings: dict[str, list[float]] = {"scan": [], "full_listing": []}
    with tempfile.TemporaryDirectory() as tmp:
        reader = OffloadStore(Path(tmp), MODEL, layout, 1 << 40)
        writer = OffloadStore(Path(tmp), MODEL, layout, args.files * reader.file_bytes(0b1))
        write(writer, args.files)
        folder = reader.folder
        reader.scan()
        for r in range(args.rounds):
            for way in ("scan", "full_listing") if r % 2 == 0 else ("full_listing", "scan"):
                times = []
                for _ in range(args.scans):
                    write(writer, args.changes)
                    started = time.thread_time()
                    found = reader.scan(full=False)[0] if way == "scan" else full_listing(folder)
                    times.append(time.thread_time() - started)
                    if found != full_listing(folder):
                        raise SystemExit(f"{way} missed files")
                timings[way].append(statistics.median(times))
        files = len(full_listing(folder))
        engine = decoding_engine(args.decodes)
        freeze_startup_heap()   # as the engine's process does once it has started (the model, the first listing)
        ways = ("alone", "listing_at_once", "paced")
        steps: dict[str, list[float]] = {way: [] for way in ways}
        walls: dict[str, list[float]] = {way: [] for way in ways}
        for r in range(args.rounds):
            for way in ways if r % 2 == 0 else ways[::-1]:
                times, wall = steps_beside(engine, None if way == "alone" else reader, way == "paced", args.steps)
                steps[way] += times
                walls[way].append(wall)
    scan_ms = statistics.median(timings["scan"]) * 1e3
    full_ms = statistics.median(timings["full_listing"]) * 1e3
    print(json.dumps({
        "scan_ms": round(scan_ms, 2), "full_listing_ms": round(full_ms, 2), "ratio": round(scan_ms / full_ms, 3),
        "files_at_the_end": files, "changes_between_scans": args.changes, "rounds": args.rounds,
        "per_round_ms": {k: [round(v * 1e3, 2) for v in vs] for k, vs in timings.items()},
        "step_ms": {way: {"p50": round(float(np.percentile(times, 50)) * 1e3, 2),
                          "p99": round(float(np.percentile(times, 99)) * 1e3, 2),
                          "max": round(max(times) * 1e3, 2)} for way, times in steps.items()},
        "step_p99_ratio_at_once": round(float(np.percentile(steps["listing_at_once"], 99)
                                              / np.percentile(steps["alone"], 99)), 3),
        "step_p99_ratio_paced": round(float(np.percentile(steps["paced"], 99) / np.percentile(steps["alone"], 99)), 3),
        "listing_wall_ms": {way: round(statistics.mean(w) * 1e3, 1) for way, w in walls.items() if way != "alone"},
        "decodes": args.decodes,
        "cpu": this_cpus_model(), "date": time.strftime("%Y-%m-%d"),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
