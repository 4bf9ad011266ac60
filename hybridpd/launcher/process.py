"""One child process of a local cluster: started in its own process group, logging to a file.

Stopping is SIGTERM to the whole group, then SIGKILL after a grace period, so grandchildren go too.
The group is only signalled while its leader is not yet reaped (a zombie still holds its pid), so a
recycled pid can never be hit.
On Linux each child also gets SIGTERM if the launching thread dies (PR_SET_PDEATHSIG), so a killed
launcher leaves nothing behind either.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child between fork and exec."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ChildProcess:
    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str]) -> None:
        self.name = name
        self.argv = tuple(argv)
        self.log_path = log_path
        with open(log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            self._popen = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=dict(env), start_new_session=True, preexec_fn=_die_with_parent,
            )

    @property
    def pid(self) -> int:
        return self._popen.pid

    def returncode(self) -> int | None:
        """None while the process runs."""
        return self._popen.poll()

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_bytes()[-16384:].decode("utf-8", "replace")
        except OSError as exc:
            return f"(cannot read the log: {exc.strerror})"
        return "\n".join(text.splitlines()[-lines:])

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self._popen.pid, sig)  # start_new_session: the group id is the child's pid
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL to the group (a crash, for chaos runs): nothing is flushed."""
        if self._popen.poll() is None:
            self._signal_group(signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM to the group, if the child is still running."""
        if self._popen.poll() is None:
            self._signal_group(signal.SIGTERM)

    def finish(self, deadline: float) -> int:
        """Waits until `deadline` (time.monotonic) for the child to exit, then SIGKILLs its group."""
        if self._popen.poll() is None:
            try:
                self._popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self._popen.wait()
        return self._popen.returncode
