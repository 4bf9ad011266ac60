"""Connector READ bandwidth between two node-like processes vs a single-process copy of the same blocks.

Each process registers two groups (block-major int8 tensors from numpy, so huge pages are advised) through
`NixlTransport`; the reader READs every block of both groups into a shuffled set of its own blocks, several
times, and we keep the median. The baseline copies the same blocks with the same scatter in one process
(the faster of a per-block `copy_` loop and `index_copy_` over int64 views of the pages, one thread).
Last line: JSON {"ratio", "nixl_gbps", "copy_gbps", "bytes", "block_bytes"}.

    .venv/bin/python benchmarks/transfer.py [--mib 256] [--iters 5] [--source-poll-ms 1]

`--source-poll-ms`: how often the source calls `get_notifs()` while the reader reads (0 = spin, -1 = never).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection

import numpy as np
import torch

from hybridpd.connector.nixl_transport import NixlTransport
from hybridpd.connector.transport import BlockRead, TransferState

GROUP_SHARES = ((0.75, 48 * 1024), (0.25, 128 * 1024))  # (share of the bytes, page size): attention-like, Mamba-like


def shapes(total_bytes: int) -> list[tuple[int, int]]:
    return [(int(total_bytes * share) // page, page) for share, page in GROUP_SHARES]


def group_tensors(group_shapes: list[tuple[int, int]], seed: int | None) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    if seed is None:
        return [torch.from_numpy(np.zeros(s, dtype=np.int8)) for s in group_shapes]
    return [torch.from_numpy(rng.integers(-128, 128, size=s, dtype=np.int8)) for s in group_shapes]


def source_main(conn: Connection, group_shapes: list[tuple[int, int]], poll_ms: float) -> None:
    torch.set_num_threads(1)
    transport = NixlTransport("bench-src", progress_thread=False)
    tensors = group_tensors(group_shapes, seed=1)
    transport.register(tensors)
    conn.send((transport.local_metadata(), transport.local_layouts()))
    received = 0
    while True:
        if conn.poll(0 if poll_ms >= 0 else None):
            if conn.recv() == "quit":
                break
        if poll_ms >= 0:
            received += len(transport.get_notifs())
            if poll_ms > 0:
                time.sleep(poll_ms / 1000)
    conn.send(received)
    transport.close()


def timed_read(transport: NixlTransport, reads: list[BlockRead], tag: bytes) -> float:
    start = time.perf_counter()
    handle = transport.start_read("bench-src", reads, tag)
    state = transport.poll(handle)
    while state is TransferState.TRANSFERRING:
        state = transport.poll(handle)
    elapsed = time.perf_counter() - start
    transport.release(handle)
    if state is not TransferState.DONE:
        raise RuntimeError(f"READ ended {state}")
    return elapsed


def nixl_gbps(group_shapes: list[tuple[int, int]], reads: list[BlockRead], iters: int, poll_ms: float) -> float:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    source = ctx.Process(target=source_main, args=(theirs, group_shapes, poll_ms), daemon=True)
    source.start()
    transport = NixlTransport("bench-dst", progress_thread=False)
    try:
        tensors = group_tensors(group_shapes, seed=None)
        transport.register(tensors)
        metadata, layouts = ours.recv()
        transport.add_peer("bench-src", metadata, layouts)
        timed_read(transport, reads[:1], b"warm-up")
        nbytes = sum(tensors[r.group_id][0].numel() for r in reads)
        times = [timed_read(transport, reads, f"iter-{i}".encode()) for i in range(iters)]
        expected = group_tensors(group_shapes, seed=1)
        for r in reads[:: max(1, len(reads) // 64)]:
            if not torch.equal(tensors[r.group_id][r.local_block], expected[r.group_id][r.remote_block]):
                raise RuntimeError(f"READ delivered wrong bytes for {r}")
        ours.send("quit")
        ours.recv()
        return nbytes / statistics.median(times) / 1e9
    finally:
        transport.close()
        source.join(timeout=10)
        if source.is_alive():
            source.kill()


def copy_gbps(group_shapes: list[tuple[int, int]], reads: list[BlockRead], iters: int) -> float:
    """The faster of two one-pass copies of the same blocks: a per-block `copy_` loop, and one `index_copy_`
    per group over int64 views of the pages (the reads take every source block in order, so no gather)."""
    src, dst = group_tensors(group_shapes, seed=1), group_tensors(group_shapes, seed=None)
    nbytes = sum(group_shapes[r.group_id][1] for r in reads)
    local = []
    for gid, (n, _) in enumerate(group_shapes):
        mine = [r for r in reads if r.group_id == gid]
        if [r.remote_block for r in mine] != list(range(n)):
            raise ValueError("the copy baseline expects every source block, in order")
        local.append(torch.tensor([r.local_block for r in mine]))

    def per_block() -> None:
        for r in reads:
            dst[r.group_id][r.local_block].copy_(src[r.group_id][r.remote_block])

    def index_copy() -> None:
        for gid, index in enumerate(local):
            dst[gid].view(torch.int64).index_copy_(0, index, src[gid].view(torch.int64))

    best = 0.0
    for copy in (per_block, index_copy):
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            copy()
            times.append(time.perf_counter() - start)
        best = max(best, nbytes / statistics.median(times) / 1e9)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--source-poll-ms", type=float, default=1.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    group_shapes = shapes(args.mib * 2**20)
    rng = np.random.default_rng(0)
    reads = [
        BlockRead(group_id=gid, remote_block=int(b), local_block=int(l))
        for gid, (n, _) in enumerate(group_shapes)
        for b, l in zip(range(n), rng.permutation(n))
    ]
    copy = copy_gbps(group_shapes, reads, args.iters)
    nixl = nixl_gbps(group_shapes, reads, args.iters, args.source_poll_ms)
    total = sum(group_shapes[r.group_id][1] for r in reads)
    print(f"groups (num_blocks, page bytes): {group_shapes}; source polls every {args.source_poll_ms} ms")
    print(json.dumps({"ratio": round(nixl / copy, 3), "nixl_gbps": round(nixl, 2), "copy_gbps": round(copy, 2),
                      "bytes": total, "block_bytes": [p for _, p in group_shapes]}))


if __name__ == "__main__":
    main()
