"""What a scan of the storage tier's directory costs a node while another node keeps writing into it.

A directory of `--files` block files of one group (the store's own layout: 256 shard folders) is scanned by one
store while another store (another node sharing the directory) writes `--changes` new files between two scans and
evicts old ones to stay within a capacity of `--files` files (a tenth at a time), as a busy cluster does between
the tier's scans (the trace replay wrote ~1,000 files per node per 5 s). Per round, alternated: the store's
`scan()` between its full listings (it reads what the other store journaled since its last scan), and a plain
scan that lists every folder and parses every name (what a full listing costs). Both are timed in CPU seconds of
this thread, the median of `--scans` scans per round, and each must find exactly what a listing finds.

Last line: JSON with `scan_ms` and `full_listing_ms` (medians over the rounds), their ratio, the files and changes,
the CPU model and the date.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from hybridpd.engine.dtype_choice import this_cpus_model
from hybridpd.engine.kv_offload.layout import GroupLayout
from hybridpd.engine.kv_offload.store import OffloadStore

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=30_000, help="the directory's size (the writer's capacity)")
    parser.add_argument("--changes", type=int, default=1_000, help="files another writer adds between two scans")
    parser.add_argument("--scans", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    layout = (GroupLayout(GROUP, PAGE),)
    payload = memoryview(bytes(PAGE))
    counter = iter(range(1 << 62))

    def write(store: OffloadStore, n: int) -> None:
        for _ in range(n):
            store.write(0, next(counter).to_bytes(8, "little").rjust(32, b"\1")[::-1], payload)

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
    scan_ms = statistics.median(timings["scan"]) * 1e3
    full_ms = statistics.median(timings["full_listing"]) * 1e3
    print(json.dumps({
        "scan_ms": round(scan_ms, 2), "full_listing_ms": round(full_ms, 2), "ratio": round(scan_ms / full_ms, 3),
        "files_at_the_end": files, "changes_between_scans": args.changes, "rounds": args.rounds,
        "per_round_ms": {k: [round(v * 1e3, 2) for v in vs] for k, vs in timings.items()},
        "cpu": this_cpus_model(), "date": time.strftime("%Y-%m-%d"),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
