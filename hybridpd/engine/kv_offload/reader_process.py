"""The storage tier's reads: block files read and checked into a shared buffer outside the engine's process
(helper_process.py says why a process), from which the tier's loader copies each group's pages into their blocks in
one call. Measured in-process on the small preset (benchmarks/README.md): a 1,536-token hit read by a thread of the
engine's process took ~36 ms beside 8 running decodes, against ~15 ms with the engine idle.

The messages: the tier sends a `HelperSetup`, then `ReadBatch`es; the process answers each with a `BatchRead`. A
batch names, per file, where in the buffer each page it wants goes; the process reads them there (one `readv` a
file, the kernel asked to read `PREFETCH` files ahead) and checks them, stopping at the first file it cannot use.
It runs at the node's priority: a request waits for its reads.
"""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from hybridpd.engine.kv_offload.file_reader import ReadOutcome, prefetch, read_into
from hybridpd.engine.kv_offload.helper_process import HelperProcess, HelperSetup, helper_main
from hybridpd.engine.kv_offload.layout import block_path, members

PREFETCH = 8   # files the process asks the kernel to read ahead of the one it reads and checks

# Started as `python -c`, not `-m`: the messages' classes must be this module's, not `__main__`'s, on both ends.
COMMAND = "import sys; from hybridpd.engine.kv_offload.reader_process import main; sys.exit(main(sys.argv[1:]))"


@dataclass(frozen=True)
class FileToRead:
    block_hash: bytes
    groups: int                          # the file's groups (a bit mask): which file of the block
    offsets: tuple[int | None, ...]      # per group of the file, in order: where its page goes, None: not wanted


@dataclass(frozen=True)
class ReadBatch:
    files: tuple[FileToRead, ...]


@dataclass(frozen=True)
class BatchRead:
    outcomes: tuple[ReadOutcome, ...]   # per file in order, up to the first that is not READ (the rest: not read)
    cpu_s: float                        # the process's CPU time so far


class ReaderProcess(HelperProcess):
    """The tier's handle on its reader process (started with the tier, again after one died): `send` a `ReadBatch`,
    `receive` its `BatchRead` (the tier keeps two batches out)."""

    def __init__(self, setup: HelperSetup, buffer_fd: int) -> None:
        super().__init__(COMMAND, setup, buffer_fd, what="reader")


def read_batch(setup: HelperSetup, batch: ReadBatch, buffer: memoryview) -> tuple[ReadOutcome, ...]:
    """Read `batch`'s files into `buffer` (the pages not wanted into scratch memory), in order, up to the first file
    that is not READ."""
    groups = setup.groups
    paths = [block_path(setup.folder, f.block_hash, f.groups) for f in batch.files]
    for path in paths[:PREFETCH]:
        prefetch(path)
    outcomes: list[ReadOutcome] = []
    for i, (file, path) in enumerate(zip(batch.files, paths)):
        if i + PREFETCH < len(paths):   # keep the disk PREFETCH files ahead of the reads and checks
            prefetch(paths[i + PREFETCH])
        held = members(file.groups)
        if len(file.offsets) != len(held):
            raise ValueError(f"a file of {len(held)} groups given {len(file.offsets)} offsets")
        into = [memoryview(bytearray(groups[g].page_bytes)) if at is None else buffer[at: at + groups[g].page_bytes]
                for g, at in zip(held, file.offsets)]
        outcome = read_into(path, setup.model_key, file.block_hash,
                            [(groups[g].key, groups[g].page_bytes) for g in held], into)
        outcomes.append(outcome)
        if outcome is not ReadOutcome.READ:
            break
    return tuple(outcomes)


def serve(buffer_fd: int, receive: Connection, answer: Connection) -> None:
    """The process's loop: batches in, pages into the buffer, one answer a batch, until the tier's pipe closes."""
    setup: HelperSetup = receive.recv()
    buffer = memoryview(mmap.mmap(buffer_fd, setup.buffer_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE))
    while True:
        try:
            batch: ReadBatch = receive.recv()
        except EOFError:
            return
        try:
            answer.send(BatchRead(read_batch(setup, batch, buffer), time.process_time()))
        except OSError:   # the tier is gone
            return


def main(argv: list[str]) -> int:
    return helper_main(argv, name="kv-reader", serve=serve)
