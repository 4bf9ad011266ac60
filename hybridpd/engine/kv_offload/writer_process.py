"""The write-behind's process: block files written from a shared staging buffer, outside the engine's process
(helper_process.py says why a process). Measured in-process on the small preset (benchmarks/README.md), against no
tier: the engine's steps took 9-21% longer with a writer thread, 6-16% with this process (less in each run that had
both).

The messages: the tier sends a `HelperSetup`, then `WriteBatch`es; the process answers each with a `BatchWritten`.
The pages themselves are in a memfd the tier maps too (the staging ring, ring.py); a batch names them by offset.
The process exits when the tier closes its pipe, or dies with it: the pipe's end is then closed, and what it had been
sent is written first.
"""

from __future__ import annotations

import mmap
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from hybridpd.engine.kv_offload.file_writer import BlockFileWriter, Written
from hybridpd.engine.kv_offload.helper_process import HelperProcess, HelperSetup, helper_main

# The process's niceness over the node's: the write-behind is background work. Where the cores are all busy (a node's
# engine steps beside other nodes on the same machine), the scheduler gives the steps the CPU first, and a writer
# that falls behind fills the staging ring, whose overflow is dropped and counted, never waited for. Linux also
# derives a process's default I/O priority from its niceness. Idle cores run it at once, as before.
NICENESS = 10

# Started as `python -c`, not `-m`: the messages' classes must be this module's, not `__main__`'s, on both ends.
COMMAND = "import sys; from hybridpd.engine.kv_offload.writer_process import main; sys.exit(main(sys.argv[1:]))"


@dataclass(frozen=True)
class WriteBatch:
    blocks: tuple[tuple[bytes, tuple[tuple[int, int], ...]], ...]   # (block hash, ((group, ring offset), ...)), ...
    masks: tuple[int, ...]   # the sets of groups files have been seen with, the largest first (BlockFileWriter.write)


@dataclass(frozen=True)
class BatchWritten:
    results: tuple[Written | str, ...]   # per block: what its write did, or the error that kept it out
    cpu_s: float                         # the process's CPU time so far


class WriterProcess(HelperProcess):
    """The tier's handle on its writer process, started at the first batch (and again after one died)."""

    def __init__(self, setup: HelperSetup, ring_fd: int) -> None:
        super().__init__(COMMAND, setup, ring_fd, what="writer")

    def write(self, batch: WriteBatch) -> BatchWritten:
        """Have the process write a batch and wait for its answer; HelperGone if it is not there to."""
        return self.call(batch)


def serve(ring_fd: int, receive: Connection, answer: Connection) -> None:
    """The process's loop: batches in, files out, one answer a batch, until the tier's pipe closes."""
    setup: HelperSetup = receive.recv()
    ring = mmap.mmap(ring_fd, setup.buffer_bytes, prot=mmap.PROT_READ)
    view = memoryview(ring)
    writer = BlockFileWriter(setup.folder, setup.model_key, setup.groups)
    sizes = [group.page_bytes for group in setup.groups]
    while True:
        try:
            batch: WriteBatch = receive.recv()
        except EOFError:
            return
        results: list[Written | str] = []
        for block_hash, pages in batch.blocks:
            try:
                results.append(writer.write(block_hash, [(g, view[at: at + sizes[g]]) for g, at in pages],
                                            batch.masks))
            except Exception as exc:  # noqa: BLE001 - one block's failure (a full disk) is that block's answer
                results.append(f"{type(exc).__name__}: {exc}")
        try:
            answer.send(BatchWritten(tuple(results), time.process_time()))
        except OSError:   # the tier is gone; what it sent is written
            return


def main(argv: list[str]) -> int:
    return helper_main(argv, name="kv-writer", serve=serve, niceness=NICENESS)
