"""The decode node's cache of prefill peers: bounded LRU, idle expiry, nothing in use evicted, clients closed and
transport peers removed on eviction (unless another address still names the same engine)."""

from __future__ import annotations

import pytest

from hybridpd.decode_node.peers import PeerCache


class Client:
    def __init__(self, address) -> None:
        self.address = address
        self.closed = False

    async def close(self) -> None:
        self.closed = True


class Transport:
    def __init__(self) -> None:
        self.removed: list[str] = []

    def remove_peer(self, name: str) -> None:
        self.removed.append(name)


def cache(capacity=2, idle_s=100.0):
    now = [0.0]
    clients: dict = {}

    def make(address):
        clients[address] = Client(address)
        return clients[address]

    transport = Transport()
    return PeerCache(make, transport, capacity=capacity, idle_s=idle_s, clock=lambda: now[0]), clients, transport, now


async def use(peers, port, transport_name=None):
    async with peers.use(("h", port)) as peer:
        if transport_name is not None:
            peer.transport_name = transport_name


async def test_past_its_capacity_the_least_recently_used_peer_is_closed():
    peers, clients, transport, _ = cache(capacity=2)
    await use(peers, 1, "E1")
    await use(peers, 2, "E2")
    await use(peers, 1)                    # 1 is now the most recent
    await use(peers, 3, "E3")
    assert len(peers) == 2 and clients[("h", 2)].closed and not clients[("h", 1)].closed
    assert transport.removed == ["E2"]


async def test_a_peer_in_use_is_never_evicted():
    peers, clients, transport, _ = cache(capacity=1)
    async with peers.use(("h", 1)):
        await use(peers, 2)                # over capacity while 1 is in use: the idle one goes
        assert not clients[("h", 1)].closed and clients[("h", 2)].closed
    assert len(peers) == 1


async def test_idle_peers_expire():
    peers, clients, transport, now = cache(capacity=8, idle_s=10.0)
    await use(peers, 1, "E1")
    now[0] = 5.0
    await use(peers, 2, "E2")
    now[0] = 12.0
    await peers.evict()
    assert clients[("h", 1)].closed and not clients[("h", 2)].closed and transport.removed == ["E1"]


async def test_a_transport_peer_another_address_still_names_is_kept():
    peers, clients, transport, _ = cache(capacity=1)
    await use(peers, 1, "E")               # the same engine, reached by two addresses
    await use(peers, 2, "E")
    assert clients[("h", 1)].closed and transport.removed == []
    await peers.close()
    assert transport.removed == ["E"]


async def test_thousands_of_distinct_peers_keep_the_cache_bounded():
    peers, clients, transport, _ = cache(capacity=64)
    for port in range(5000):
        await use(peers, port, f"E{port}")
    assert len(peers) == 64
    assert sum(not c.closed for c in clients.values()) == 64 and len(transport.removed) == 5000 - 64


@pytest.mark.parametrize("capacity, idle_s", [(0, 1.0), (1, 0.0)])
def test_a_cache_out_of_range_is_refused(capacity, idle_s):
    with pytest.raises(ValueError):
        PeerCache(lambda a: None, Transport(), capacity=capacity, idle_s=idle_s)
