"""The proxy's KV event feed of one node survives what a node answers: a `/kv_events` answer that is not an object,
and a replay buffer holding a batch it cannot decode (then it backs off instead of replaying in a hot loop)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from hybridpd.kv_events.wire import END_OF_REPLAY, seq_bytes
from hybridpd.proxy.kv_feed import NodeFeed

CHECK_S = 0.05
WATCH_S = 1.5   # how long a test watches the feed (a bound on what it may do meanwhile, not a timing assertion)


class FakeEventsNode:
    """`GET /kv_events` answering `answer`; with a replay ROUTER that sends one undecodable batch."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.info_calls = 0
        self.replays = 0
        self._ctx = zmq.asyncio.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self.replay_port = self._router.bind_to_random_port("tcp://127.0.0.1")
        self._pub = self._ctx.socket(zmq.PUB)
        self.pub_port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        self._task: asyncio.Task | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def _info(self, request: web.Request) -> web.Response:
        self.info_calls += 1
        return web.json_response(self.answer(self))

    async def _serve_replays(self) -> None:
        while True:
            identity, _empty, _start = await self._router.recv_multipart()
            self.replays += 1
            await self._router.send_multipart((identity, b"", seq_bytes(0), b"\xc1 not msgpack"))
            await self._router.send_multipart((identity, b"", END_OF_REPLAY, b""))

    async def __aenter__(self) -> FakeEventsNode:
        app = web.Application()
        app.router.add_get("/kv_events", self._info)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        self._task = asyncio.create_task(self._serve_replays())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        await self._runner.cleanup()
        self._router.close(linger=0)
        self._pub.close(linger=0)
        self._ctx.term()


def info_with_bad_replay(node: FakeEventsNode) -> dict:
    return {"endpoint": f"tcp://127.0.0.1:{node.pub_port}", "replay_endpoint": f"tcp://127.0.0.1:{node.replay_port}",
            "topic": "kv", "instance_id": "i-1",
            "groups": [{"group_idx": 0, "kind": "full_attention", "block_size": 16, "sliding_window": None}]}


async def watch(node: FakeEventsNode) -> tuple[NodeFeed, asyncio.Task]:
    ctx = zmq.asyncio.Context()
    async with aiohttp.ClientSession() as session:
        feed = NodeFeed(("127.0.0.1", 1), node.url, session, ctx, check_interval=CHECK_S, timeout=0.5)
        task = asyncio.create_task(feed.run())
        await asyncio.sleep(WATCH_S)
        alive = not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    ctx.term()
    assert alive, task.exception() if task.done() and not task.cancelled() else "the feed's task ended"
    return feed, task


@pytest.mark.parametrize("answer", [[], "x", {"groups": "none"}, {"instance_id": "i"}])
async def test_a_kv_events_answer_that_is_not_an_info_object_never_ends_the_feed(answer):
    async with FakeEventsNode(lambda node: answer) as node:
        feed, _ = await watch(node)
    assert feed.index is None and node.info_calls >= 2   # it keeps asking, knowing nothing of the node


async def test_an_undecodable_batch_in_the_replay_buffer_backs_the_feed_off():
    async with FakeEventsNode(info_with_bad_replay) as node:
        feed, _ = await watch(node)
    # without a backoff it replayed hundreds of times in this window; with one doubling from 50 ms, at most ~6
    assert 1 <= node.replays <= 8, node.replays
    assert feed.restarts == node.replays
