"""A helper process of the storage tier (its writer, its reader): a small Python process, started with a shared
buffer's file descriptor and two pipes, that takes one message at a time and answers each.

Why processes and not threads: a thread that makes system calls (open, read, write, rename, utime) and hashes gives
the GIL up and takes it back around each, ~10 times a file, and each time it takes it back the engine's thread,
forced to let it go, waits for it to come back; the engine's steps slow down and the thread's own files wait behind
the steps. A helper shares no GIL with the engine: per batch of files the engine's process sends one message and
reads one answer, and the bytes go through the shared buffer (a memfd both map).

The wire: multiprocessing's framing of pickled messages over two pipes; first the helper's setup, then requests,
each answered by a message with a `cpu_s` attribute (the helper's CPU time so far). The helper exits when its pipe
closes, or dies with it.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, NoReturn

from hybridpd.engine.kv_offload.layout import GroupLayout
from hybridpd.named_thread import name_native_thread

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HelperSetup:
    """A helper's first message: the store's folder, whose blocks it holds, and the shared buffer's size."""

    folder: str
    model_key: bytes
    groups: tuple[GroupLayout, ...]
    buffer_bytes: int


class HelperGone(Exception):
    """The helper process died or could not start; the next call starts another."""


class HelperProcess:
    """The tier's handle on one helper process, started at the first call (or at `start`) and again after one died.

    `command`: the `python -c` program (its `main` reads the shared buffer's descriptor and the two pipes' from its
    arguments); `setup`: the first message it gets."""

    def __init__(self, command: str, setup: HelperSetup, shared_fd: int, *, what: str) -> None:
        self._command = command
        self._setup = setup
        self._shared_fd = shared_fd
        self._what = what   # for messages: "writer", "reader"
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
        """CPU seconds every process of this helper has used, as far as their answers said."""
        return self._cpu_before + self._cpu

    def start(self) -> None:
        """Start the process now (HelperGone if it cannot), not at the first call."""
        if self._process is None:
            try:
                self._start()
            except OSError as exc:
                raise HelperGone(f"the kv offload {self._what} process could not start ({exc})") from exc

    def call(self, request: object) -> Any:
        """Send `request`, wait for the answer; HelperGone if the process is not there to answer."""
        self.send(request)
        return self.receive()

    def send(self, request: object) -> None:
        """Send `request` without waiting: its answer is the next `receive`'s (answers come in the order sent)."""
        try:
            if self._process is None:
                self._start()
            assert self._to is not None
            self._to.send(request)
        except (OSError, EOFError) as exc:
            self._gone(exc)

    def receive(self) -> Any:
        """The answer to the oldest request not yet answered; HelperGone if the process is not there to answer."""
        try:
            if self._from is None:
                raise EOFError("no process")
            answer = self._from.recv()
        except (OSError, EOFError) as exc:
            self._gone(exc)
        self._cpu = answer.cpu_s
        return answer

    def _gone(self, exc: BaseException) -> NoReturn:
        self._stop(kill=True)
        raise HelperGone(f"the kv offload {self._what} process is gone ({exc or type(exc).__name__})") from exc

    def close(self, timeout: float) -> None:
        """Let the process finish what it was sent (up to `timeout` seconds) and exit."""
        self._stop(kill=False, timeout=timeout)

    def kill(self) -> None:
        """End the process now (one stuck in a read of a directory that hangs); a call waiting on it gets HelperGone."""
        process = self._process
        if process is not None:
            process.kill()

    def _start(self) -> None:
        to_child, to_helper = os.pipe()
        from_helper, from_child = os.pipe()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", self._command, str(self._shared_fd), str(to_child), str(from_child)],
                pass_fds=(self._shared_fd, to_child, from_child), stdin=subprocess.DEVNULL)
        except BaseException:
            for fd in (to_child, to_helper, from_helper, from_child):
                os.close(fd)
            raise
        os.close(to_child)
        os.close(from_child)
        self._to = Connection(to_helper, readable=False)
        self._from = Connection(from_helper, writable=False)
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
            log.warning("kv offload: the %s process did not finish in %.1f s; killed", self._what, timeout)
            process.kill()
            process.wait()
        self._cpu_before += self._cpu
        self._cpu = 0.0


def helper_main(argv: list[str], *, name: str, serve: Callable[[int, Connection, Connection], None],
                niceness: int = 0) -> int:
    """A helper process's `main`: `argv` holds the shared buffer's descriptor and its two pipes' ends; it takes
    `name` (what top and ps show), `niceness` over the node's, and serves until the tier's pipe closes."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s {name}: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a Ctrl-C reaches the node too: it closes the pipe, this ends
    name_native_thread(name)
    if niceness:
        os.nice(niceness)
    buffer_fd, receive_fd, answer_fd = (int(arg) for arg in argv)
    serve(buffer_fd, Connection(receive_fd, writable=False), Connection(answer_fd, readable=False))
    return 0
