"""A body asking for `n` > 1 samples of one prompt, through P/D: each sample is a request of its own through the
nodes (proxy/bodies.sample_bodies: `n` 1, seed + i), and their answers are merged into the one the client asked for,
as a node answers such a body itself: choice i from sample i, the first sample's id, the prompt counted once in the
usage.

A stream: the first sample goes alone until its stream opens (its prompt is then cached on its prefill node, where
the others, routed to the same prompt, find it), then the others; the client's stream opens with the first sample's
and carries every sample's chunks as they come, each at its index, then one usage chunk and one [DONE]. Before the
stream opens, the first sample's failure is the answer (its status, its body); after, any failure is an error event
that ends every sample. Not streamed: all samples at once; the first failure is the answer and ends the others.
A client that leaves cancels every sample (each closes its node calls, which abort).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

from hybridpd.proxy.bodies import wants_stream
from hybridpd.proxy.prefill_stream import sse_payloads
from hybridpd.proxy.replies import Reply, sse_headers
from hybridpd.proxy.responses import error_body, error_response

Route = Callable[[Reply, dict[str, Any], str], Awaitable[web.StreamResponse]]
T = TypeVar("T")
_DONE = b"data: [DONE]\n\n"


class _SampleReply:
    """One sample's stream, fed into the merged one."""

    def __init__(self, index: int, arrivals: asyncio.Queue[tuple[int, bytes | None]]) -> None:
        self._index = index
        self._arrivals = arrivals
        self.opened = asyncio.Event()

    async def open(self, status: int, headers: dict[str, str]) -> None:
        self.opened.set()

    async def write(self, data: bytes) -> None:
        self._arrivals.put_nowait((self._index, data))

    async def close(self) -> web.StreamResponse:
        return web.StreamResponse()   # a placeholder: the merged stream is what the client gets

    @property
    def started(self) -> bool:
        return False   # the merged stream opens when a sample's does

    async def wait(self, pending: Awaitable[T]) -> T:
        return await pending


async def merge_samples(request: web.Request, bodies: list[dict[str, Any]], request_id: str,
                        route: Route) -> web.StreamResponse:
    if wants_stream(bodies[0]):
        return await _SampleStreams(request, bodies, request_id, route).run()
    return await _answers(bodies, request_id, route)


def _sample_id(request_id: str, index: int) -> str:
    return f"{request_id}-{index}"


def _as_client_answer(response: web.StreamResponse, request_id: str) -> web.StreamResponse:
    response.headers["X-Request-Id"] = request_id
    return response


async def _answers(bodies: list[dict[str, Any]], request_id: str, route: Route) -> web.StreamResponse:
    arrivals: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue()
    tasks = [asyncio.create_task(route(_SampleReply(i, arrivals), body, _sample_id(request_id, i)))
             for i, body in enumerate(bodies)]
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.result().status != 200:
                    return _as_client_answer(task.result(), request_id)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    try:
        answers = [json.loads(task.result().body) for task in tasks]   # type: ignore[attr-defined]
        merged = _merged_answer(answers)
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        return error_response(502, f"a sample's answer is not a completion: {exc}", "bad_gateway", request_id)
    return web.json_response(merged, headers={"X-Request-Id": request_id})


def _merged_answer(answers: list[dict[str, Any]]) -> dict[str, Any]:
    choices = [{**answer["choices"][0], "index": i} for i, answer in enumerate(answers)]
    return {**answers[0], "choices": choices, "usage": _merged_usage([a.get("usage") for a in answers]),
            "kv_transfer_params": None}


def _merged_usage(usages: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The prompt counted once (the first sample's), every sample's completion tokens; None unless every sample
    reported its usage."""
    if any(not isinstance(u, dict) or not _counts(u) for u in usages):
        return None
    first = usages[0]
    assert first is not None
    completion = sum(u["completion_tokens"] for u in usages if u is not None)
    return {**first, "completion_tokens": completion, "total_tokens": first["prompt_tokens"] + completion}


def _counts(usage: dict[str, Any]) -> bool:
    return all(isinstance(usage.get(key), int) for key in ("prompt_tokens", "completion_tokens"))


class _SampleStreams:
    def __init__(self, request: web.Request, bodies: list[dict[str, Any]], request_id: str, route: Route) -> None:
        self._request = request
        self._bodies = bodies
        self._request_id = request_id
        self._route = route
        self._arrivals: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[web.StreamResponse]] = []
        self._pending = [b""] * len(bodies)       # each sample's bytes not yet a whole event
        self._usages: list[dict[str, Any] | None] = [None] * len(bodies)
        self._header: dict[str, Any] | None = None   # the first chunk's id, object, created and model: the stream's

    def _start(self, index: int) -> _SampleReply:
        reply = _SampleReply(index, self._arrivals)
        task = asyncio.create_task(self._route(reply, self._bodies[index], _sample_id(self._request_id, index)))
        task.add_done_callback(lambda _: self._arrivals.put_nowait((index, None)))
        self._tasks.append(task)
        return reply

    async def run(self) -> web.StreamResponse:
        try:
            first = self._start(0)
            opened = asyncio.create_task(first.opened.wait())
            await asyncio.wait((opened, self._tasks[0]), return_when=asyncio.FIRST_COMPLETED)
            opened.cancel()
            if not first.opened.is_set():
                return _as_client_answer(await self._tasks[0], self._request_id)
            for index in range(1, len(self._bodies)):
                self._start(index)
            out = web.StreamResponse(status=200, headers=sse_headers(self._request_id))
            await out.prepare(self._request)
            try:
                await self._relay(out)
                await out.write_eof()
            except ConnectionResetError:
                pass   # the client went away; the samples are cancelled below
            return out
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _relay(self, out: web.StreamResponse) -> None:
        running = len(self._bodies)
        while running:
            index, data = await self._arrivals.get()
            if data is None:
                running -= 1
                failure = self._failure(index)
                if failure is not None:
                    await out.write(b"data: " + json.dumps(failure).encode() + b"\n\n" + _DONE)
                    return
                continue
            events, self._pending[index] = _split_events(self._pending[index] + data)
            for payload in events:
                event = self._event(index, payload)
                if event is not None:
                    await out.write(event)
                    if event.endswith(_DONE):   # a sample's error event: the stream ends with it
                        return
        usage = _merged_usage(self._usages) if any(u is not None for u in self._usages) else None
        if usage is not None and self._header is not None:
            await out.write(_data({**self._header, "choices": [], "usage": usage}))
        await out.write(_DONE)

    def _failure(self, index: int) -> dict[str, Any] | None:
        """A sample that ended without its stream (an error answered before it opened): its error, as an event."""
        task = self._tasks[index]
        response = task.result() if not task.cancelled() and task.exception() is None else None
        if response is None:
            return error_body(f"sample {index} failed", "bad_gateway", 502)
        if response.status == 200:
            return None
        try:
            body = json.loads(response.body)   # type: ignore[attr-defined]
        except (ValueError, TypeError):
            body = None
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return body
        return error_body(f"sample {index} failed: HTTP {response.status}", "bad_gateway", response.status)

    def _event(self, index: int, payload: bytes) -> bytes | None:
        """A sample's event as the merged stream's: its chunk at the sample's index under the stream's id; its usage
        kept for the end; its [DONE] dropped; its error passed on with [DONE] (the stream ends)."""
        if payload == b"[DONE]":
            return None
        try:
            chunk = json.loads(payload)
        except ValueError:
            chunk = None
        if not isinstance(chunk, dict) or not isinstance(chunk.get("choices", []), list):
            return _data(error_body(f"sample {index}'s stream holds an event that is not a chunk: {payload[:80]!r}",
                                    "bad_gateway", 502)) + _DONE
        if "error" in chunk:
            return _data(chunk) + _DONE
        if self._header is None:
            self._header = {key: chunk.get(key) for key in ("id", "object", "created", "model")}
        if not chunk.get("choices") and "usage" in chunk:
            self._usages[index] = chunk["usage"]
            return None
        chunk["id"], chunk["created"] = self._header["id"], self._header["created"]
        for choice in chunk["choices"]:
            if isinstance(choice, dict):
                choice["index"] = index
        return _data(chunk)


def _data(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _split_events(raw: bytes) -> tuple[list[bytes], bytes]:
    """The whole events' data payloads in `raw`, and what is left of an event not yet whole."""
    raw = raw.replace(b"\r\n", b"\n")
    end = raw.rfind(b"\n\n")
    if end < 0:
        return [], raw
    return sse_payloads(raw[:end]), raw[end + 2:]
