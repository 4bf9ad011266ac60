"""Admission for graceful shutdown: count requests in flight; once closed, refuse new ones (503).

States: OPEN (admit) -> DRAINING (refuse new, let running ones finish) -> IDLE (none in flight).
`main.py` on SIGTERM: `admission.close()`, `await admission.wait_idle(grace)`, then stop the runner (which
cancels what is left: each handler closes its engine generator, aborting the request).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from hybridpd.errors import ServerOverloadedError


class Admission:
    def __init__(self) -> None:
        self._open = True
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def accepting(self) -> bool:
        return self._open

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def close(self) -> None:
        self._open = False

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        if not self._open:
            raise ServerOverloadedError("the server is shutting down and admits no new requests")
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """True when no request is in flight within `timeout` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
