"""The proxy's `--sse-keep-alive-interval`: a client's chat or completions stream gets `: keep-alive` comments while
the prefill call runs (the stream opened early, at 200), while the decode node is quiet between events, never inside
an event the decode node sends in pieces; a failure after the comments is the stream's error event. Responses streams
and a proxy without the flag send none. What the client reads, comments left out, is what it reads without them."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from hybridpd.sse_keep_alive import KEEP_ALIVE

from .fake_node import Behavior

INTERVAL = 0.02   # seconds: comments come quickly; nothing below depends on how many
DEADLINE = 30     # a guard against a hang, never reached when the stream behaves
COMPLETION = {"prompt": "hi", "max_tokens": 3, "stream": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3, "stream": True}


def data_events(raw: bytes) -> list[bytes]:
    """The stream as an SSE client reads it: its events, comments left out; every event whole."""
    blocks = raw.split(b"\n\n")
    assert blocks[-1] == b"", raw[-60:]
    return [block for block in blocks[:-1] if not block.startswith(b":")]


async def read_until_keep_alives(resp, count: int) -> bytes:
    seen = b""
    while seen.count(KEEP_ALIVE) < count:
        seen += await asyncio.wait_for(resp.content.readuntil(b"\n\n"), DEADLINE)
    return seen


async def plain_stream(make_harness, path: str, body: dict) -> list[bytes]:
    h = await make_harness([Behavior.OK], [Behavior.OK])
    async with h.session.post(h.url + path, json=body) as resp:
        return data_events(await resp.read())


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
async def test_a_long_prefill_call_opens_the_stream_with_keep_alives(make_harness, path, body):
    expected = await plain_stream(make_harness, path, body)
    h = await make_harness([Behavior.OK], [Behavior.OK], sse_keep_alive=INTERVAL)
    h.prefill[0].hold = asyncio.Event()
    async with h.session.post(h.url + path, json=body) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
        seen = await read_until_keep_alives(resp, 2)
        assert seen == KEEP_ALIVE * seen.count(KEEP_ALIVE)   # nothing else before the prefill answers
        h.prefill[0].hold.set()
        raw = seen + await asyncio.wait_for(resp.read(), DEADLINE)
    assert data_events(raw) == expected
    assert len(h.decode[0].received) == 1


async def test_a_quiet_decode_node_gets_keep_alives_between_events_only(make_harness):
    expected = await plain_stream(make_harness, "/v1/completions", COMPLETION)
    h = await make_harness([Behavior.OK], [Behavior.OK], sse_keep_alive=INTERVAL)
    node = h.decode[0]
    node.hold, node.hold_mid_event, node.hold_after_event = asyncio.Event(), asyncio.Event(), asyncio.Event()
    async with h.session.post(h.url + "/v1/completions", json=COMPLETION) as resp:
        head = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), DEADLINE)   # the prefill node's token
        await asyncio.wait_for(node.arrived.wait(), DEADLINE)
        seen = head + await read_until_keep_alives(resp, 1)   # the decode node quiet before its answer
        node.hold.set()
        await asyncio.sleep(10 * INTERVAL)   # the node halfway into its first event: no comment may come now
        node.hold_mid_event.set()
        seen += await read_until_keep_alives(resp, 1)   # quiet after that event
        node.hold_after_event.set()
        raw = seen + await asyncio.wait_for(resp.read(), DEADLINE)
    assert data_events(raw) == expected   # every event whole: no comment inside one


async def test_a_prefill_node_refusing_after_keep_alives_is_an_error_event(make_harness):
    h = await make_harness([Behavior.REJECT], [Behavior.OK], sse_keep_alive=INTERVAL)
    h.prefill[0].hold = asyncio.Event()
    async with h.session.post(h.url + "/v1/completions", json=COMPLETION) as resp:
        seen = await read_until_keep_alives(resp, 1)
        h.prefill[0].hold.set()
        raw = seen + await asyncio.wait_for(resp.read(), DEADLINE)
    events = data_events(raw)
    assert resp.status == 200 and events[-1] == b"data: [DONE]" and b"max_tokens must be >= 1" in events[0]
    assert h.decode[0].received == []


async def test_a_client_that_leaves_during_keep_alives_cancels_the_prefill_call(make_harness):
    h = await make_harness([Behavior.HANG], [Behavior.OK], sse_keep_alive=INTERVAL)
    async with h.session.post(h.url + "/v1/completions", json=COMPLETION) as resp:
        await read_until_keep_alives(resp, 1)
    await asyncio.wait_for(h.prefill[0].cancelled.wait(), DEADLINE)
    assert h.decode[0].received == []


@pytest.mark.parametrize("keep_alive, path, body", [
    (None, "/v1/completions", COMPLETION),
    (INTERVAL, "/v1/responses", {"input": "hi", "max_output_tokens": 3, "stream": True}),
])
async def test_no_keep_alives_without_the_flag_or_on_typed_event_streams(make_harness, keep_alive, path, body):
    h = await make_harness([Behavior.OK], [Behavior.OK], sse_keep_alive=keep_alive)
    h.prefill[0].hold = asyncio.Event()

    async def call() -> tuple[int, bytes]:
        async with h.session.post(h.url + path, json=body) as resp:
            return resp.status, await resp.read()

    answer = asyncio.create_task(call())
    await asyncio.wait_for(h.prefill[0].arrived.wait(), DEADLINE)
    await asyncio.sleep(10 * INTERVAL)   # quiet for ten intervals: a comment would have gone out
    h.prefill[0].hold.set()
    status, raw = await asyncio.wait_for(answer, DEADLINE)
    assert status == 200 and b": keep-alive" not in raw and raw
    assert len(h.decode[0].received) == 1 and len(h.prefill[0].received) == 1   # no fallback, no retry


@pytest.mark.parametrize("value", ["-1", "inf"])
def test_the_flag_refuses(value):
    done = subprocess.run([sys.executable, "-m", "hybridpd", "proxy", "--prefiller-hosts", "127.0.0.1",
                           "--prefiller-ports", "1", "--decoder-hosts", "127.0.0.1", "--decoder-ports", "2",
                           "--sse-keep-alive-interval", value], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--sse-keep-alive-interval" in done.stderr
