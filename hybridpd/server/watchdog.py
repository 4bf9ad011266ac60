"""The node front's watchdog over its engine process: is the engine alive and making progress?

The engine process sends a `Heartbeat(steps, busy)` every `BEAT_INTERVAL_S` from a thread beside the engine thread.
The front's verdict, from the last beat and the last time the step count moved:

    ALIVE      beats come, and the engine steps (or has nothing to do)
    SILENT     no beat for `silent_after` seconds: the engine process is stopped, or starved
    STALLED    beats come, work waits, and no step has ended for `stall_after` seconds: the engine thread is wedged
               (a step that runs that long counts too: the bound is generous on purpose)
    DEAD       the link closed or the engine reported its thread's death

`/health` answers 503 unless ALIVE, so the proxy's probes eject the node; DEAD also makes the front exit non-zero,
so the supervisor (`hybridpd up`, Kubernetes) restarts the whole node.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

BEAT_INTERVAL_S = 1.0


class EngineVerdict(enum.Enum):
    ALIVE = "alive"
    SILENT = "silent"
    STALLED = "stalled"
    DEAD = "dead"


@dataclass(frozen=True, kw_only=True)
class WatchdogBounds:
    silent_after: float = 10.0
    stall_after: float = 60.0

    def __post_init__(self) -> None:
        if not BEAT_INTERVAL_S < self.silent_after:
            raise ValueError(f"the heartbeat bound must exceed the beat interval ({BEAT_INTERVAL_S} s)")
        if self.stall_after <= 0:
            raise ValueError(f"--engine-stall-timeout must be positive, got {self.stall_after}")


class Watchdog:
    """Fed by the link's reader (`beat`, `dead`), asked by `/health` (`verdict`). Thread-safe in practice: it only
    assigns whole values."""

    def __init__(self, bounds: WatchdogBounds, clock: Callable[[], float] = time.monotonic) -> None:
        self.bounds = bounds
        self._clock = clock
        now = clock()
        self._last_beat = now
        self._last_progress = now
        self._steps = -1
        self._busy = False
        self._dead: str | None = None

    def beat(self, steps: int, busy: bool) -> None:
        now = self._clock()
        self._last_beat = now
        if steps != self._steps or not busy:
            self._last_progress = now
        self._steps, self._busy = steps, busy

    def dead(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason

    def verdict(self) -> tuple[EngineVerdict, str]:
        """The verdict and a reason a person can read."""
        now = self._clock()
        if self._dead is not None:
            return EngineVerdict.DEAD, self._dead
        if now - self._last_beat > self.bounds.silent_after:
            return EngineVerdict.SILENT, f"no heartbeat from the engine process for {now - self._last_beat:.0f} s"
        if self._busy and now - self._last_progress > self.bounds.stall_after:
            return EngineVerdict.STALLED, (f"work is queued and the engine has not finished a step for "
                                           f"{now - self._last_progress:.0f} s")
        return EngineVerdict.ALIVE, "ok"
