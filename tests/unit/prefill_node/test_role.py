"""The prefill role progresses its transport only while a decoder may be reading: from a lease's first heartbeat
(sent beside the READ) until the lease is released or expires; a lease whose decoder has not started needs none."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from hybridpd.connector.metrics import ConnectorMetrics
from hybridpd.prefill_node.role import PrefillRole

DEADLINE = 10.0  # seconds a test waits for an event before it fails (never a timing assertion)
QUIET = 0.03     # seconds in which a loop that polls every millisecond would poll many times


class CountingTransport:
    def __init__(self) -> None:
        self.polls = 0

    def get_notifs(self) -> list[tuple[str, bytes]]:
        self.polls += 1
        return []


class RecordingEngine:
    """The AsyncEngine surface the role uses to free blocks."""

    def __init__(self) -> None:
        self.calls = 0

    def call_soon(self, fn) -> None:
        self.calls += 1


@contextlib.asynccontextmanager
async def running_role() -> AsyncIterator[tuple[PrefillRole, CountingTransport]]:
    """A started role (its progress and expiry loops running), stopped on the way out."""
    transport = CountingTransport()
    role = PrefillRole(RecordingEngine(), transport, engine_id="e", advertised_host="127.0.0.1",
                       side_channel_port=1, lease_seconds=60.0, metrics=ConnectorMetrics(CollectorRegistry()))
    role.start()
    try:
        yield role, transport
    finally:
        await role.stop()


async def polls_after(transport: CountingTransport, seconds: float) -> int:
    before = transport.polls
    await asyncio.sleep(seconds)
    return transport.polls - before


async def wait_for_polls(transport: CountingTransport, count: int) -> None:
    async def polled() -> None:
        while transport.polls < count:
            await asyncio.sleep(0.001)
    await asyncio.wait_for(polled(), DEADLINE)


async def test_polls_from_the_first_heartbeat_until_release():
    async with running_role() as (role, transport):
        lease = role.leases.add("r", ((1,),), 16)
        assert await polls_after(transport, QUIET) == 0      # held, nobody reading yet
        role.heartbeat("r", lease.secret)
        await wait_for_polls(transport, 5)
        assert role.release("r", aborted=False, secret=lease.secret)
        await asyncio.sleep(0.005)                           # the loop's current sleep ends
        assert await polls_after(transport, QUIET) == 0


async def test_a_lease_that_ends_otherwise_stops_the_polling():
    async with running_role() as (role, transport):
        reading, waiting = role.leases.add("a", ((1,),), 16), role.leases.add("b", ((2,),), 16)
        role.heartbeat("a", reading.secret)
        await wait_for_polls(transport, 3)
        role.leases.drain()                                  # as if both expired: the sweeper's path
        await asyncio.sleep(0.005)
        assert await polls_after(transport, QUIET) == 0
        assert waiting.request_id not in role.leases


async def test_a_refused_heartbeat_starts_no_polling():
    async with running_role() as (role, transport):
        role.leases.add("r", ((1,),), 16)
        with pytest.raises(LookupError, match="wrong lease secret"):
            role.heartbeat("r", "not-the-secret")
        assert await polls_after(transport, QUIET) == 0
