"""The write-behind's process: block files written from a shared staging buffer, outside the engine's process.

Why a process and not a thread: a thread that creates, writes and renames files gives the GIL up and takes it back
around every system call, ~10 times a file, and each time it takes it back the engine's thread, forced to let it
go, waits for it to come back. Measured in-process on the small preset (benchmarks/README.md), against no tier:
the engine's steps took 9-21% longer with a writer thread, 6-16% with this process (less in each run that had
both). It shares no GIL with the engine: per batch of files the engine's process sends one message and reads one answer.

The wire, over two pipes (multiprocessing's framing, pickled messages of this module): the tier sends a
`WriterSetup`, then `WriteBatch`es; the process answers each with a `BatchWritten`. The pages themselves are in a
memfd the tier maps too (the staging ring, ring.py); a batch names them by offset. The process exits when the tier
closes its pipe, or dies with it: the pipe's end is then closed, and what it had been sent is written first.
"""

from __future__ import annotations

import logging
import mmap
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from hybridpd.engine.kv_offload.file_writer import BlockFileWriter, Written
from hybridpd.engine.kv_offload.layout import GroupLayout
from hybridpd.named_thread import name_native_thread

log = logging.getLogger(__name__)

# The process's niceness over the node's: the write-behind is background work. Where the cores are all busy (a node's
# engine steps beside other nodes on the same machine), the scheduler gives the steps the CPU first, and a writer
# that falls behind fills the staging ring, whose overflow is dropped and counted, never waited for. Linux also
# derives a process's default I/O priority from its niceness. Idle cores run it at once, as before.
NICENESS = 10

# Started as `python -c`, not `-m`: the messages' classes must be this module's, not `__main__`'s, on both ends.
COMMAND = "import sys; from hybridpd.engine.kv_offload.writer_process import main; sys.exit(main(sys.argv[1:]))"


@dataclass(frozen=True)
class WriterSetup:
    folder: str
    model_key: bytes
    groups: tuple[GroupLayout, ...]
    ring_bytes: int


@dataclass(frozen=True)
class WriteBatch:
    blocks: tuple[tuple[bytes, tuple[tuple[int, int], ...]], ...]   # (block hash, ((group, ring offset), ...)), ...
    masks: tuple[int, ...]   # the sets of groups files have been seen with, the largest first (BlockFileWriter.write)


@dataclass(frozen=True)
class BatchWritten:
    results: tuple[Written | str, ...]   # per block: what its write did, or the error that kept it out
    cpu_s: float                         # the process's CPU time so far


class WriterGone(Exception):
    """The writer process died or could not start; the next batch starts another."""


class WriterProcess:
    """The tier's handle on its writer process, started at the first batch (and again after one died)."""

    def __init__(self, setup: WriterSetup, ring_fd: int) -> None:
        self._setup = setup
        self._ring_fd = ring_fd
        self._process: subprocess.Popen | None = None
        self._to: Connection | None = None
        self._from: Connection | None = None
        self._cpu_before = 0.0   # the CPU time of the processes before this one
        self._cpu = 0.0

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def cpu_s(self) -> float:
        """CPU seconds every writer process of this tier has used, as far as their answers said."""
        return self._cpu_before + self._cpu

    def write(self, batch: WriteBatch) -> BatchWritten:
        """Have the process write a batch and wait for its answer; WriterGone if it is not there to."""
        try:
            if self._process is None:
                self._start()
            assert self._to is not None and self._from is not None
            self._to.send(batch)
            answer = self._from.recv()
        except (OSError, EOFError) as exc:
            self._stop(kill=True)
            raise WriterGone(f"the kv offload writer process is gone ({exc or type(exc).__name__})") from exc
        self._cpu = answer.cpu_s
        return answer

    def close(self, timeout: float) -> None:
        """Let the process finish what it was sent (up to `timeout` seconds) and exit."""
        self._stop(kill=False, timeout=timeout)

    def _start(self) -> None:
        to_child, to_writer = os.pipe()
        from_writer, from_child = os.pipe()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", COMMAND, str(self._ring_fd), str(to_child), str(from_child)],
                pass_fds=(self._ring_fd, to_child, from_child), stdin=subprocess.DEVNULL)
        except BaseException:
            for fd in (to_child, to_writer, from_writer, from_child):
                os.close(fd)
            raise
        os.close(to_child)
        os.close(from_child)
        self._to = Connection(to_writer, readable=False)
        self._from = Connection(from_writer, writable=False)
        self._to.send(self._setup)

    def _stop(self, kill: bool, timeout: float = 1.0) -> None:
        for conn in (self._to, self._from):
            if conn is not None:
                conn.close()
        self._to = self._from = None
        process, self._process = self._process, None
        if process is None:
            return
        if kill:
            process.kill()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("kv offload: the writer process did not finish in %.1f s; killed", timeout)
            process.kill()
            process.wait()
        self._cpu_before += self._cpu
        self._cpu = 0.0


def serve(ring_fd: int, receive: Connection, answer: Connection) -> None:
    """The process's loop: batches in, files out, one answer a batch, until the tier's pipe closes."""
    setup: WriterSetup = receive.recv()
    ring = mmap.mmap(ring_fd, setup.ring_bytes, prot=mmap.PROT_READ)
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
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s kv-offload-writer: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a Ctrl-C reaches the node too: it closes the pipe, this finishes
    name_native_thread("kv-writer")   # what top and ps show for this process
    os.nice(NICENESS)
    ring_fd, receive_fd, answer_fd = (int(arg) for arg in argv)
    serve(ring_fd, Connection(receive_fd, writable=False), Connection(answer_fd, readable=False))
    return 0
