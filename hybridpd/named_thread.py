"""Threads whose operating-system name is their Python name.

Python 3.11 keeps a thread's name to itself: every thread of a node reads "python" in `top -H`, `ps -L`,
`/proc/PID/task/TID/comm` and a profiler's per-thread view, so an operator cannot tell the engine's step from the
storage tier's writer or the KV-event publisher by their CPU. A `NamedThread` gives itself its name (the first 15
bytes: the kernel's limit) as it starts; where the C library has no `prctl` (not Linux) the name stays Python's.
"""

from __future__ import annotations

import ctypes
import threading

PR_SET_NAME = 15
NAME_BYTES = 15   # the kernel's TASK_COMM_LEN, 16, less the terminating NUL


def name_native_thread(name: str) -> bool:
    """Give the calling thread `name` (cut to its first 15 bytes) as its operating-system name; False where it
    cannot be (no `prctl`, or the call failed)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    return prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:NAME_BYTES]), 0, 0, 0) == 0


class NamedThread(threading.Thread):
    """A `threading.Thread` that names itself to the operating system as it starts."""

    def run(self) -> None:
        name_native_thread(self.name)
        super().run()
