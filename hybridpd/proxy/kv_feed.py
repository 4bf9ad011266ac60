"""Keeps the proxy's NodeIndex of each node in step with the node's KV events.

One feed per node (host:port; a node listed in both roles has one): ask the node where it publishes
(`GET /kv_events`), subscribe, replay from sequence 0 (what happened before the subscription), then apply batches
in sequence order:
- a batch numbered at or below the last applied is a duplicate (live and replayed overlap): skipped;
- a gap (a batch lost on PUB, e.g. past the high-water mark) is filled by a replay from the first missing
  number; if the node no longer buffers it, the index starts over from what the replay still has;
- every `check_interval` the feed asks `/kv_events` again: a new `instance_id` (the node restarted: new cache, new
  numbering) starts over; no answer (the node is down) drops its index until it answers, so a node that stops
  answering leaves the routing's knowledge at once.
While a feed has no index the routing knows nothing of that node (a predicted hit of 0).
A follow that fails (a batch the proxy cannot decode, a replay that does not answer, any error) starts over after a
backoff that doubles up to `MAX_BACKOFF_S` and starts over once a follow has lasted that long; nothing a node
answers ends the feed's task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from hybridpd.kv_events.wire import END_OF_REPLAY, GroupInfo, decode_batch, seq_bytes, seq_of
from hybridpd.proxy.config import Upstream
from hybridpd.proxy.block_holders import BlockHolders
from hybridpd.proxy.kv_index import NodeIndex

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0


@dataclass(frozen=True, kw_only=True)
class EventsInfo:
    """A node's answer to GET /kv_events."""

    endpoint: str | None
    replay_endpoint: str | None
    topic: str
    instance_id: str
    groups: tuple[GroupInfo, ...]

    @classmethod
    def from_json(cls, raw: object) -> EventsInfo:
        """Raises ValueError (or KeyError, TypeError) for an answer that is not a node's events info."""
        if not isinstance(raw, dict) or not isinstance(raw.get("groups"), list):
            raise ValueError("the /kv_events answer is not an object with a list of groups")
        return cls(
            endpoint=raw.get("endpoint"), replay_endpoint=raw.get("replay_endpoint"), topic=str(raw.get("topic", "")),
            instance_id=str(raw["instance_id"]),
            groups=tuple(GroupInfo(group_idx=int(g["group_idx"]), kind=str(g["kind"]), block_size=int(g["block_size"]),
                                   sliding_window=g.get("sliding_window")) for g in raw["groups"]),
        )


class _StartOver(Exception):
    """The feed must fetch the node's info and build its index again."""


class NodeFeed:
    def __init__(self, address: tuple[str, int], base_url: str, session: aiohttp.ClientSession,
                 ctx: zmq.asyncio.Context, *, check_interval: float = 1.0, timeout: float = 2.0,
                 holders: BlockHolders | None = None) -> None:
        self.address = address
        self._holders = holders
        self._url = base_url + "/kv_events"
        self._session = session
        self._ctx = ctx
        self._check_interval = check_interval
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self.index: NodeIndex | None = None
        self.batches = 0        # applied
        self.gaps = 0           # sequence gaps met (filled by replay or started over)
        self.restarts = 0       # times the feed started over

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = self._check_interval
        while True:
            info = await self._info()
            if info is None or info.endpoint is None:
                self.index = None
                await asyncio.sleep(self._check_interval)
                continue
            started = loop.time()
            try:
                await self._follow(info)
            except _StartOver as reason:
                logger.info("KV events of %s:%d: %s; rebuilding its index", *self.address, reason)
            except (zmq.ZMQError, msgspec.DecodeError, ValueError) as exc:
                logger.warning("KV events of %s:%d: %s; rebuilding its index in %.0f s", *self.address, exc, backoff)
            except Exception:   # noqa: BLE001 - one bad answer must not end the feed for good
                logger.exception("KV events of %s:%d failed; rebuilding its index in %.0f s", *self.address, backoff)
            self.restarts += 1
            self.index = None
            if loop.time() - started >= MAX_BACKOFF_S:
                backoff = self._check_interval
            await asyncio.sleep(backoff)
            backoff = min(MAX_BACKOFF_S, backoff * 2)

    async def _info(self) -> EventsInfo | None:
        try:
            async with self._session.get(self._url, timeout=self._timeout) as response:
                if response.status != 200:
                    return None
                return EventsInfo.from_json(await response.json())
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError, AttributeError):
            return None

    async def _follow(self, info: EventsInfo) -> None:
        sub = self._ctx.socket(zmq.SUB)
        try:
            sub.setsockopt_string(zmq.SUBSCRIBE, info.topic)
            sub.connect(info.endpoint)
            index = NodeIndex(info.groups, self._holders)
            try:
                await self._follow_with(info, sub, index)
            finally:
                self.index = None
                index.close()
        finally:
            sub.close(linger=0)

    async def _follow_with(self, info: EventsInfo, sub: zmq.asyncio.Socket, index: NodeIndex) -> None:
        """Replay what the node buffered, then apply its live batches in order (a gap is filled by a replay)."""
        last = await self._replay(info, index, 0, -1)
        self.index = index
        loop = asyncio.get_running_loop()
        next_check = loop.time() + self._check_interval
        while True:
            timeout_ms = max(0, int((next_check - loop.time()) * 1000))
            if await sub.poll(timeout_ms):
                _topic, seq_frame, payload = await sub.recv_multipart()
                seq = seq_of(seq_frame)
                if seq <= last:
                    continue
                if seq > last + 1:
                    self.gaps += 1
                    last = await self._replay(info, index, last + 1, last)
                    if seq <= last:
                        continue
                index.apply(decode_batch(payload).events)
                self.batches += 1
                last = seq
            if loop.time() >= next_check:
                now = await self._info()
                if now is None:
                    raise _StartOver("the node does not answer")
                if now.instance_id != info.instance_id:
                    raise _StartOver("the node restarted")
                next_check = loop.time() + self._check_interval

    async def _replay(self, info: EventsInfo, index: NodeIndex, start: int, last: int) -> int:
        """Apply every buffered batch from `start` on; returns the last applied number. Without a replay endpoint,
        or when the node no longer has `start`, what is missing is lost: the index starts over from here."""
        if info.replay_endpoint is None:
            if start > 0:
                index.clear()
            return last
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.connect(info.replay_endpoint)
            await dealer.send_multipart((b"", seq_bytes(start)))
            first = True
            while True:
                if not await dealer.poll(int(self._timeout.total * 1000)):
                    raise _StartOver("the replay did not answer")
                _empty, seq_frame, payload = await dealer.recv_multipart()
                if seq_frame == END_OF_REPLAY:
                    return last
                seq = seq_of(seq_frame)
                if first and seq > start and start > 0:
                    index.clear()  # the batches in between are gone: what they removed is unknown
                first = False
                if seq > last:
                    index.apply(decode_batch(payload).events)
                    self.batches += 1
                    last = seq
        finally:
            dealer.close(linger=0)


class KVFeeds:
    """The feeds of the current nodes: `reconcile` starts one per new node and stops those of nodes that left."""

    def __init__(self, session: aiohttp.ClientSession, base_url: Callable[[Upstream], str], *,
                 check_interval: float = 1.0, timeout: float = 2.0) -> None:
        self._session = session
        self._base_url = base_url
        self._ctx = zmq.asyncio.Context()
        self._check_interval = check_interval
        self._timeout = timeout
        self._feeds: dict[tuple[str, int], tuple[NodeFeed, asyncio.Task]] = {}
        self.holders = BlockHolders()   # shared by every node's index (block_holders.py)

    def index(self, upstream: Upstream) -> NodeIndex | None:
        entry = self._feeds.get((upstream.host, upstream.port))
        return entry[0].index if entry is not None else None

    def feeds(self) -> list[NodeFeed]:
        return [feed for feed, _ in self._feeds.values()]

    def reconcile(self, upstreams: Iterable[Upstream]) -> None:
        wanted = {(u.host, u.port): u for u in upstreams}
        for address in list(self._feeds):
            if address not in wanted:
                _, task = self._feeds.pop(address)
                task.cancel()
        for address, upstream in wanted.items():
            if address not in self._feeds:
                feed = NodeFeed(address, self._base_url(upstream), self._session, self._ctx,
                                check_interval=self._check_interval, timeout=self._timeout, holders=self.holders)
                self._feeds[address] = (feed, asyncio.create_task(feed.run(), name=f"kv-feed-{upstream.address}"))

    async def close(self) -> None:
        tasks = [task for _, task in self._feeds.values()]
        self._feeds.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._ctx.term()
