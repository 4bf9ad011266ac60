"""vLLM's `--sse-keep-alive-interval` on the node: a chat or completions stream that waits longer than the interval
(queued or prefilling before its first output, or between outputs) sends `: keep-alive` comments; one that waits
before its first output starts at 200 with them, and a failure then is the stream's error event. Responses and
Messages streams send none (as vLLM's). Every request ends in the engine: none is left running."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from hybridpd.server.args import BadArgumentsError
from hybridpd.sse_keep_alive import KEEP_ALIVE, awaited

from .conftest import MODEL, make_app, parse_sse, serve_configs as configs
from .fake_engine import FakeEngine

INTERVAL = 0.02   # seconds: keep-alive comments come quickly; nothing below depends on how many
WAIT = 30         # a guard against a hang, never reached when the stream behaves
USER = [{"role": "user", "content": "x"}]
BODIES = {
    "/v1/completions": {"prompt": "x", "max_tokens": 3, "stream": True},
    "/v1/chat/completions": {"messages": USER, "max_tokens": 3, "stream": True},
}


async def events_until(resp, count: int) -> list[bytes]:
    """The stream's events as they arrive (each up to its blank line), until `count` keep-alive comments came."""
    seen: list[bytes] = []
    while seen.count(KEEP_ALIVE) < count:
        seen.append(await asyncio.wait_for(resp.content.readuntil(b"\n\n"), WAIT))
    return seen


async def started(engine: FakeEngine, keep_alive: float | None = INTERVAL) -> TestClient:
    client = TestClient(TestServer(make_app(engine, sse_keep_alive=keep_alive)))
    await client.start_server()
    return client


def payloads(raw: bytes) -> list:
    """The stream's data events with its comments left out (as SSE clients read it)."""
    kept = b"".join(block + b"\n\n" for block in raw.split(b"\n\n")[:-1] if not block.startswith(b":"))
    return parse_sse(kept.decode())


@pytest.mark.parametrize("path", list(BODIES))
async def test_a_stream_waiting_for_its_first_output_sends_keep_alives_then_the_same_chunks(path):
    quiet = FakeEngine()
    plain = await started(quiet, keep_alive=None)
    try:
        expected = payloads(await (await plain.post(path, json=BODIES[path])).read())
    finally:
        await plain.close()
    engine = FakeEngine(stall_before_first=asyncio.Event())
    client = await started(engine)
    try:
        resp = await client.post(path, json=BODIES[path])
        assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
        seen = await events_until(resp, 2)
        assert set(seen) == {KEEP_ALIVE}    # nothing but comments before the first output
        engine.stall_before_first.set()
        rest = b"".join(seen) + await asyncio.wait_for(resp.read(), WAIT)
    finally:
        await client.close()
    strip = [{k: v for k, v in e.items() if k not in ("id", "created")} if isinstance(e, dict) else e
             for e in payloads(rest)]
    assert strip == [{k: v for k, v in e.items() if k not in ("id", "created")} if isinstance(e, dict) else e
                     for e in expected]
    assert engine.aborted == []


async def test_a_stream_waiting_between_outputs_sends_keep_alives():
    engine = FakeEngine(stall_after_first=asyncio.Event())
    client = await started(engine)
    try:
        resp = await client.post("/v1/chat/completions", json=BODIES["/v1/chat/completions"])
        seen = await events_until(resp, 2)
        assert seen[0].startswith(b"data: ") and KEEP_ALIVE not in seen[:1]   # the first chunk came first
        engine.stall_after_first.set()
        raw = b"".join(seen) + await asyncio.wait_for(resp.read(), WAIT)
    finally:
        await client.close()
    events = payloads(raw)
    assert events[-1] == "[DONE]" and "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]
                                              if e["choices"]) == "abc"


async def test_a_failure_after_keep_alives_is_the_streams_error_event():
    engine = FakeEngine(stall_before_first=asyncio.Event(), fail_at_output=0)
    client = await started(engine)
    try:
        resp = await client.post("/v1/completions", json=BODIES["/v1/completions"])
        seen = await events_until(resp, 1)
        engine.stall_before_first.set()
        raw = b"".join(seen) + await asyncio.wait_for(resp.read(), WAIT)
    finally:
        await client.close()
    events = payloads(raw)
    assert resp.status == 200 and events[-1] == "[DONE]" and "error" in events[0] and len(events) == 2


async def test_a_client_that_leaves_during_keep_alives_aborts_its_request():
    engine = FakeEngine(stall_before_first=asyncio.Event())
    client = await started(engine)
    try:
        resp = await client.post("/v1/completions", json=BODIES["/v1/completions"])
        await events_until(resp, 1)
        resp.close()
        await asyncio.wait_for(engine.aborted_event.wait(), WAIT)
    finally:
        await client.close()
    assert len(engine.aborted) == 1


async def test_several_choices_stream_keep_alives_too():
    engine = FakeEngine(stall_before_first=asyncio.Event())
    client = await started(engine)
    try:
        resp = await client.post("/v1/completions", json={**BODIES["/v1/completions"], "n": 2})
        await events_until(resp, 1)
        engine.stall_before_first.set()
        events = payloads(await asyncio.wait_for(resp.read(), WAIT))
    finally:
        await client.close()
    assert events[-1] == "[DONE]" and {e["choices"][0]["index"] for e in events[:-1]} == {0, 1}


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"input": "x", "max_output_tokens": 3, "stream": True}),
    ("/v1/messages", {"model": MODEL, "messages": USER, "max_tokens": 3, "stream": True}),
])
async def test_responses_and_messages_streams_send_none(path, body):
    """As vLLM's: the flag is for chat and completions; typed event streams keep to their events."""
    engine = FakeEngine(stall_after_first=asyncio.Event())
    client = await started(engine)
    try:
        resp = await client.post(path, json=body)
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), WAIT)
        await asyncio.sleep(10 * INTERVAL)   # quiet for ten intervals: a keep-alive would have gone out
        engine.stall_after_first.set()
        raw = first + await asyncio.wait_for(resp.read(), WAIT)
    finally:
        await client.close()
    assert resp.status == 200 and b": keep-alive" not in raw and json.loads(raw.split(b"data: ")[1].split(b"\n")[0])


async def test_awaited_passes_results_and_errors_through():
    ticks = []

    async def idle() -> None:
        ticks.append(1)

    gate = asyncio.Event()

    async def later() -> str:
        await gate.wait()
        return "done"

    task = asyncio.create_task(awaited(later(), INTERVAL, idle))
    while not ticks:
        await asyncio.sleep(INTERVAL)
    gate.set()
    assert await task == "done"
    assert await awaited(asyncio.sleep(0, "now"), None, idle) == "now"

    async def fails() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError):
        await awaited(fails(), INTERVAL, idle)


@pytest.mark.parametrize("argv, interval", [([], None), (["--sse-keep-alive-interval", "0"], None),
                                            (["--sse-keep-alive-interval", "15"], 15.0)])
def test_the_flag(argv, interval):
    assert configs(argv).server.sse_keep_alive == interval


@pytest.mark.parametrize("value", ["-1", "inf", "nan"])
def test_the_flag_refuses(value):
    with pytest.raises(BadArgumentsError, match="--sse-keep-alive-interval"):
        configs(["--sse-keep-alive-interval", value])
