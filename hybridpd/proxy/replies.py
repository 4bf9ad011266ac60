"""Where a routed request's streamed answer goes: the client's own connection, or (one sample of a body asking for
`n` > 1, proxy/samples.py) the stream that merges the samples. A non-streamed answer is a `web.Response` either way.

With `--sse-keep-alive-interval` a chat or completions stream to the client gets `: keep-alive` comments whenever it
has been quiet that long (hybridpd/sse_keep_alive.py): from a ticker while it is open, written only between events
(the decode node's bytes are relayed as they come, an event possibly in pieces); and while the proxy waits for the
prefill node's answer, by opening the stream early (status 200: a failure then is the stream's error event).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from typing import Protocol, TypeVar

from aiohttp import web

from hybridpd.proxy.prefill_stream import SSE_CONTENT_TYPE
from hybridpd.sse_keep_alive import KEEP_ALIVE, awaited

T = TypeVar("T")


def sse_headers(request_id: str) -> dict[str, str]:
    """The headers of a stream the proxy opens to its client itself."""
    return {"Content-Type": SSE_CONTENT_TYPE, "Cache-Control": "no-cache", "X-Request-Id": request_id}


class Reply(Protocol):
    async def open(self, status: int, headers: dict[str, str]) -> None:
        """Sends the status and headers; called once, before the first write."""

    async def write(self, data: bytes) -> None: ...

    async def close(self) -> web.StreamResponse:
        """Ends the stream; what the handler returns."""

    @property
    def started(self) -> bool:
        """Whether keep-alive comments opened the stream already (an answer from here on is the stream's)."""

    async def wait(self, pending: Awaitable[T]) -> T:
        """`pending`'s result; a reply that keeps its client's stream alive opens it and sends keep-alive comments
        while this takes longer than its interval."""


class ClientReply:
    """The client's connection; with `keep_alive` seconds, a stream kept alive (the module's docstring)."""

    def __init__(self, request: web.Request, keep_alive: float | None = None, request_id: str = "") -> None:
        self._request = request
        self._response: web.StreamResponse | None = None
        self._interval = keep_alive
        self._request_id = request_id
        self._lock = asyncio.Lock()          # the ticker's writes and the relay's, one at a time
        self._between_events = True          # the last bytes written ended an event
        self._last_write = time.monotonic()
        self._ticker: asyncio.Task[None] | None = None

    @property
    def started(self) -> bool:
        return self._response is not None

    async def open(self, status: int, headers: dict[str, str]) -> None:
        """Sends the status and headers, unless keep-alive comments opened the stream already (status 200)."""
        if self._response is not None:
            return
        self._response = web.StreamResponse(status=status, headers=headers)
        await self._response.prepare(self._request)
        self._last_write = time.monotonic()
        if self._interval is not None:
            self._ticker = asyncio.create_task(self._tick(self._interval))

    async def write(self, data: bytes) -> None:
        assert self._response is not None, "open() first"
        async with self._lock:
            await self._response.write(data)
            self._between_events = data.endswith(b"\n\n")
            self._last_write = time.monotonic()

    async def close(self) -> web.StreamResponse:
        assert self._response is not None, "open() first"
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        await self._response.write_eof()
        return self._response

    async def wait(self, pending: Awaitable[T]) -> T:
        if self._interval is None or self._response is not None:   # once open, the ticker keeps it alive
            return await pending
        return await awaited(pending, self._interval, self._open_early)

    async def _open_early(self) -> None:
        if self._response is None:
            await self.open(200, sse_headers(self._request_id))
            await self._keep_alive()

    async def _keep_alive(self) -> None:
        async with self._lock:
            if self._between_events:
                assert self._response is not None
                await self._response.write(KEEP_ALIVE)
                self._last_write = time.monotonic()

    async def _tick(self, interval: float) -> None:
        """Keep-alive comments whenever nothing was written for `interval` seconds (a client gone ends it)."""
        with contextlib.suppress(ConnectionResetError):
            while self._request.transport is not None and not self._request.transport.is_closing():
                quiet = time.monotonic() - self._last_write
                if quiet < interval:
                    await asyncio.sleep(interval - quiet)
                    continue
                await self._keep_alive()
                if not self._between_events:   # mid-event: look again soon, not a whole interval later
                    await asyncio.sleep(interval / 4)
