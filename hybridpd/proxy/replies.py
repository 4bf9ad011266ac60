"""Where a routed request's streamed answer goes: the client's own connection, or (one sample of a body asking for
`n` > 1, proxy/samples.py) the stream that merges the samples. A non-streamed answer is a `web.Response` either way."""

from __future__ import annotations

from typing import Protocol

from aiohttp import web


class Reply(Protocol):
    async def open(self, status: int, headers: dict[str, str]) -> None:
        """Sends the status and headers; called once, before the first write."""

    async def write(self, data: bytes) -> None: ...

    async def close(self) -> web.StreamResponse:
        """Ends the stream; what the handler returns."""


class ClientReply:
    """The client's connection."""

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self._response: web.StreamResponse | None = None

    async def open(self, status: int, headers: dict[str, str]) -> None:
        self._response = web.StreamResponse(status=status, headers=headers)
        await self._response.prepare(self._request)

    async def write(self, data: bytes) -> None:
        assert self._response is not None, "open() first"
        await self._response.write(data)

    async def close(self) -> web.StreamResponse:
        assert self._response is not None, "open() first"
        await self._response.write_eof()
        return self._response
