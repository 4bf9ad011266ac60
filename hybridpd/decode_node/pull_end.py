"""The end of one pull, with one owner: what the engine hears when a remotely prefilled request's READ is over.

Two facts arrive on the event loop, in either order: the pull's verdict (`succeed`, or `fail` with the error) and,
only when a READ we gave up on could not be cancelled, that it has stopped (`read_outstanding`, then
`read_stopped`). The engine hears exactly one verdict per pull, and never lets the request's blocks go while a
READ may still write into them:

    verdict    READ outstanding?   the engine hears
    ok         no                  complete_load                     (the request decodes)
    ok         yes                 complete_load once it stopped
    failed     no                  fail_load(error, recompute)       (fails it, or prefills it here)
    failed     yes, fail policy    fail(error) at once               (the client hears now; the scheduler keeps the
                                   + release_load once it stopped      blocks of a loading request, then frees them)
    failed     yes, recompute      fail_load(error, recompute) once it stopped

States: PULLING -> (READ_STUCK) -> ENDED; every late or repeated call is ignored.
"""

from __future__ import annotations

import enum
from typing import Protocol


class EngineCalls(Protocol):
    """What a pull's end asks of the engine (posted to the engine thread)."""

    def complete_load(self, request_id: str) -> None: ...

    def fail_load(self, request_id: str, error: Exception, recompute: bool) -> None: ...

    def fail(self, request_id: str, error: Exception) -> None: ...

    def release_load(self, request_id: str) -> None:
        """The loader is done with a request already failed: the scheduler frees its blocks."""


class PullState(enum.Enum):
    PULLING = "pulling"
    READ_STUCK = "read_stuck"     # a READ could not be cancelled: the blocks stay until it stops
    ENDED = "ended"


class PullEnd:
    def __init__(self, request_id: str, engine: EngineCalls, *, recompute: bool) -> None:
        self.request_id = request_id
        self._engine = engine
        self._recompute = recompute
        self.state = PullState.PULLING
        self._verdict: tuple[bool, Exception | None] | None = None
        self._told_failure = False

    def read_outstanding(self) -> None:
        if self.state is PullState.PULLING:
            self.state = PullState.READ_STUCK

    def read_stopped(self) -> None:
        if self.state is not PullState.READ_STUCK:
            return
        self.state = PullState.PULLING
        if self._verdict is not None:
            self._deliver()

    def succeed(self) -> None:
        self._decide(True, None)

    def fail(self, error: Exception) -> None:
        self._decide(False, error)

    def _decide(self, ok: bool, error: Exception | None) -> None:
        if self._verdict is not None or self.state is PullState.ENDED:
            return
        self._verdict = (ok, error)
        if self.state is PullState.PULLING:
            self._deliver()
        elif not ok and not self._recompute:  # READ stuck: tell the client now, free the blocks later
            self._engine.fail(self.request_id, error)  # type: ignore[arg-type]
            self._told_failure = True

    def _deliver(self) -> None:
        assert self._verdict is not None
        self.state = PullState.ENDED
        ok, error = self._verdict
        if ok:
            self._engine.complete_load(self.request_id)
        elif self._told_failure:
            self._engine.release_load(self.request_id)
        else:
            self._engine.fail_load(self.request_id, error, self._recompute)  # type: ignore[arg-type]
