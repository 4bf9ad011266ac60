"""The choices of one body (`n` > 1, several prompts) streamed as one SSE stream, as vLLM streams them: each choice's
chunks at its index as its outputs come, interleaved; after every choice has finished, one usage chunk (each prompt
counted once) and one [DONE].

The first output to arrive decides the status: a failure there is the HTTP error (nothing was sent yet); a failure
after it is an error event that ends the stream. Whoever calls this closes every choice's outputs afterwards (the
ones not finished are aborted).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from aiohttp import web

from hybridpd.engine.request import RequestOutput
from hybridpd.server.metrics import RequestTracker
from hybridpd.server.outputs import EngineOutputs
from hybridpd.server.protocol import ParsedRequest
from hybridpd.server.responses import choices_usage
from hybridpd.server.streaming import (
    ChunkBuilder, RequestFailed, SseStream, end_stream, failure, sse, write_output,
)

Arrival = tuple[int, RequestOutput | Exception]   # a choice's position and its next output, or why it has none


async def _pump(position: int, outputs: EngineOutputs, arrivals: asyncio.Queue[Arrival]) -> None:
    """One choice's outputs into the shared queue, up to its finished one."""
    try:
        while True:
            output = await outputs.next()
            arrivals.put_nowait((position, output))
            if output.finished:
                return
    except Exception as exc:  # noqa: BLE001 - the stream reports it
        arrivals.put_nowait((position, exc))


def _error(item: RequestOutput | Exception) -> Exception | None:
    return item if isinstance(item, Exception) else failure(item)


async def stream_choices(stream: SseStream, requests: Sequence[ParsedRequest], outputs: Sequence[EngineOutputs],
                         builders: Sequence[ChunkBuilder], trackers: Sequence[RequestTracker],
                         headers: dict[str, str]) -> web.StreamResponse:
    arrivals: asyncio.Queue[Arrival] = asyncio.Queue()
    pumps = [asyncio.create_task(_pump(k, o, arrivals)) for k, o in enumerate(outputs)]
    try:
        return await _stream(stream, requests, arrivals, builders, trackers, headers)
    finally:
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _stream(stream: SseStream, requests: Sequence[ParsedRequest], arrivals: asyncio.Queue[Arrival],
                  builders: Sequence[ChunkBuilder], trackers: Sequence[RequestTracker],
                  headers: dict[str, str]) -> web.StreamResponse:
    position, item = await stream.wait(arrivals.get())
    error = _error(item)
    if error is not None:
        if isinstance(item, RequestOutput):
            trackers[position].observe(item)
        if stream.response is None:
            raise error
        return await end_stream(stream.response, error)   # keep-alive comments went out: the status with them
    response = await stream.start(headers)
    last: list[RequestOutput | None] = [None] * len(requests)
    try:
        while True:
            if isinstance(item, Exception):
                raise RequestFailed(item)
            await write_output(response, builders[position], trackers[position], item)
            if item.finished:
                last[position] = item
                if all(output is not None for output in last):
                    break
            position, item = await stream.wait(arrivals.get())
        if requests[0].include_usage:
            finals = [output for output in last if output is not None]
            await response.write(sse(builders[0].usage_chunk(choices_usage(requests, finals))))
    except ConnectionResetError:
        return response  # the client went away: the caller aborts what is left
    except Exception as exc:  # noqa: BLE001 - a failure after the status went out becomes an error event
        return await end_stream(response, exc)
    return await end_stream(response, None)
