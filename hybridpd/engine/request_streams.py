"""Where an engine's outputs meet the requests waiting for them: one queue per request, on an event loop.

The engine runs elsewhere (its own thread in `AsyncEngine`, or the node's engine process behind
`hybridpd.server.remote_engine`); whatever carries its outputs calls the `OutputSink` methods from any thread, and
`stream()` yields them to the request's consumer in the order they were sent.

A consumer that leaves before its request finished asks the engine to abort it; its id stays busy until the engine
says it has (`aborted`), so that a new request with the same id never receives the old one's outputs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Protocol

from hybridpd.engine.request import FinishReason, RequestOutput
from hybridpd.errors import EngineDeadError, ServerOverloadedError


class OutputSink(Protocol):
    """What an engine sends back. Called on the engine's own thread; no method may block."""

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """One step's (or one inbox item's) outputs, in order."""

    def rejected(self, request_id: str, error: Exception) -> None:
        """The engine refused the request before taking it (it holds nothing for it)."""

    def aborted(self, request_id: str) -> None:
        """The engine has aborted the request (or never had it): no output of it follows."""

    def died(self, error: BaseException) -> None:
        """The engine stopped for good; every request in flight ends with an error."""


def dead_output(request_id: str, error: BaseException) -> RequestOutput:
    return RequestOutput(request_id=request_id, new_token_ids=(), new_text="", num_prompt_tokens=0,
                         num_cached_tokens=0, num_output_tokens=0, finished=True, finish_reason=FinishReason.ERROR,
                         error=EngineDeadError(f"the engine stopped: {error}"))


class RequestStreams:
    """The consumer side of an engine: an `OutputSink` that hands each output to its request's `stream()`."""

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self._closing: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def __len__(self) -> int:
        return len(self._queues)

    async def stream(self, request_id: str, submit: Callable[[], None],
                     abort: Callable[[], None]) -> AsyncGenerator[RequestOutput, None]:
        """Yield the outputs of `request_id` until the finished one. `submit()` sends the request to the engine;
        `abort()` asks the engine to drop it when the consumer leaves first. A rejection is raised here."""
        if request_id in self._queues or request_id in self._closing:
            raise ServerOverloadedError(f"request id {request_id} is already in flight")
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            submit()
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True  # rejected: the engine holds nothing to abort
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._closing.add(request_id)
                abort()

    # -- OutputSink: any thread --------------------------------------------------------------------------------------
    def deliver(self, outputs: list[RequestOutput]) -> None:
        self._call(self._put_all, outputs)

    def rejected(self, request_id: str, error: Exception) -> None:
        self._call(self._put, request_id, error)

    def aborted(self, request_id: str) -> None:
        self._call(self._closing.discard, request_id)

    def died(self, error: BaseException) -> None:
        self._call(self._fail_all, error)

    def _call(self, fn: Callable[..., None], *args: object) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)

    # -- event loop side -------------------------------------------------------------------------------------------
    def _put_all(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _put(self, request_id: str, item: RequestOutput | Exception) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(item)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, queue in self._queues.items():
            queue.put_nowait(dead_output(request_id, error))
        self._closing.clear()  # nothing is left to abort
