"""A stream of typed events onto the wire (`event: <type>` / `data: <json>`, no `[DONE]`): the events of each
output as they come. A Responses API stream (response_objects.ResponseEvents) and an Anthropic Messages one
(message_objects.MessageEvents) are such streams.

As a chat stream (streaming.py): a request that fails once the status went out ends with an `error` event; a client
that goes away shows up as ConnectionResetError, and the caller closes the engine generator, which aborts the
request.
"""

from __future__ import annotations

from typing import Any, Protocol

from aiohttp import web

from hybridpd.engine.request import RequestOutput
from hybridpd.server.errors import HTTPError, http_error_for
from hybridpd.server.metrics import RequestTracker
from hybridpd.server.outputs import EngineOutputs
from hybridpd.server.response_objects import event_bytes
from hybridpd.server.streaming import SseStream, failure


class Events(Protocol):
    def start(self) -> list[dict[str, Any]]: ...

    def events(self, output: RequestOutput) -> list[dict[str, Any]]: ...

    def error(self, error: HTTPError) -> dict[str, Any]: ...


async def stream_events(stream: SseStream, first: RequestOutput, rest: EngineOutputs, events: Events,
                        tracker: RequestTracker, headers: dict[str, str]) -> web.StreamResponse:
    response = await stream.start(headers)
    try:
        for event in events.start():
            await response.write(event_bytes(event))
        output = first
        while True:
            tracker.observe(output)
            error = failure(output)
            if error is not None:
                raise error
            for event in events.events(output):
                await response.write(event_bytes(event))
            if output.finished:
                break
            output = await rest.next()
    except ConnectionResetError:
        return response
    except Exception as exc:  # noqa: BLE001 - a failure after the status went out becomes an error event
        try:
            await response.write(event_bytes(events.error(http_error_for(exc))))
        except ConnectionResetError:
            return response
    try:
        await response.write_eof()
    except ConnectionResetError:
        pass
    return response
