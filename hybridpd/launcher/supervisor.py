"""Keeps a started local cluster serving: a child (node or proxy) that dies after start-up is restarted.

Per child: RUNNING -> (it exits) -> BACKING_OFF -> (the backoff has passed) -> RUNNING again, on the same argv,
ports and log file, each restart logged with the exit cause (exit code or signal name). The backoff doubles
after each exit (1 s, 2 s, 4 s, ... at most 30 s) and starts over once a child has run for a minute. With
`RestartPolicy.NEVER` the first exit is an error, as `hybridpd up --restart never` wants. A failure during start-up
is not this module's: `LocalCluster.start` exits at once.
"""

from __future__ import annotations

import enum
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from hybridpd.launcher.errors import ChildExitedError
from hybridpd.launcher.process import ChildProcess

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 60.0


class RestartPolicy(enum.Enum):
    ON_FAILURE = "on-failure"
    NEVER = "never"


class ChildState(enum.Enum):
    RUNNING = "running"
    BACKING_OFF = "backing_off"


@dataclass
class _Watched:
    child: ChildProcess
    state: ChildState
    started: float
    backoff: float = FIRST_BACKOFF_S
    restart_at: float = 0.0
    restarts: int = 0


def exit_cause(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


class Supervisor:
    """`check()` from one thread, periodically: it notices exits and restarts what is due."""

    def __init__(self, children: list[ChildProcess], policy: RestartPolicy,
                 respawn: Callable[[ChildProcess], ChildProcess], clock: Callable[[], float] = time.monotonic,
                 report: Callable[[str], None] = print) -> None:
        self._policy = policy
        self._respawn = respawn
        self._clock = clock
        self._report = report
        now = clock()
        self._watched = [_Watched(child=c, state=ChildState.RUNNING, started=now) for c in children]

    def restarts(self, name: str) -> int:
        return next(w.restarts for w in self._watched if w.child.name == name)

    def check(self) -> None:
        now = self._clock()
        for watched in self._watched:
            if watched.state is ChildState.RUNNING:
                code = watched.child.returncode()
                if code is None:
                    if now - watched.started >= STABLE_AFTER_S:
                        watched.backoff = FIRST_BACKOFF_S
                    continue
                if self._policy is RestartPolicy.NEVER:
                    raise ChildExitedError(watched.child.name, code, watched.child.log_path, watched.child.log_tail())
                watched.state, watched.restart_at = ChildState.BACKING_OFF, now + watched.backoff
                self._report(f"hybridpd up: {watched.child.name} {exit_cause(code)}; restarting it in "
                             f"{watched.backoff:.0f} s (log: {watched.child.log_path})")
                watched.backoff = min(MAX_BACKOFF_S, watched.backoff * 2)
            elif now >= watched.restart_at:
                watched.child = self._respawn(watched.child)
                watched.state, watched.started = ChildState.RUNNING, now
                watched.restarts += 1
                self._report(f"hybridpd up: restarted {watched.child.name} (pid {watched.child.pid}, "
                             f"restart {watched.restarts})")
