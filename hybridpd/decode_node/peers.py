"""The prefill nodes a decode node pulls from: one side-channel client and one transport peer per side-channel
address, kept in a bounded LRU with idle expiry.

Addresses come from requests (`kv_transfer_params.remote_host:remote_port`), so they are not ours to trust to stay
few: prefill pods come and go under DNS discovery, and a client can name any port. An entry in use (a pull, a
release) is never evicted; past `capacity` the least recently used idle entries are, and every entry unused for
`idle_s` is. Eviction closes the gRPC channel (which would otherwise keep reconnecting) and removes the transport
peer unless another address still names the same engine.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from hybridpd.connector.side_channel_client import SideChannelClient
from hybridpd.connector.transport import Transport

Address = tuple[str, int]
DEFAULT_CAPACITY = 64
DEFAULT_IDLE_S = 300.0


@dataclass(kw_only=True)
class Peer:
    """One prefill node as this decode node knows it (mutable: the cache's own record)."""

    client: SideChannelClient
    transport_name: str | None = None   # its engine's transport peer, once its metadata was checked
    in_use: int = 0
    last_used: float = 0.0


class PeerCache:
    def __init__(self, make_client: Callable[[Address], SideChannelClient], transport: Transport, *,
                 capacity: int = DEFAULT_CAPACITY, idle_s: float = DEFAULT_IDLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1 or idle_s <= 0:
            raise ValueError(f"a peer cache needs capacity >= 1 and idle_s > 0, got {capacity}, {idle_s}")
        self._make_client = make_client
        self._transport = transport
        self._capacity = capacity
        self._idle_s = idle_s
        self._clock = clock
        self._peers: OrderedDict[Address, Peer] = OrderedDict()
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._peers)

    @contextlib.asynccontextmanager
    async def use(self, address: Address) -> AsyncIterator[Peer]:
        """The peer at `address` (created on first use), held out of eviction for the block."""
        peer = self._peers.get(address)
        if peer is None:
            peer = self._peers[address] = Peer(client=self._make_client(address))
        self._peers.move_to_end(address)
        peer.in_use += 1
        try:
            yield peer
        finally:
            peer.in_use -= 1
            peer.last_used = self._clock()
            await self.evict()

    async def evict(self) -> None:
        """Close what is idle too long, then the least recently used idle peers past the capacity."""
        now = self._clock()
        idle = [a for a, p in self._peers.items() if not p.in_use and now - p.last_used >= self._idle_s]
        over = len(self._peers) - len(idle) - self._capacity
        if over > 0:
            idle += [a for a, p in self._peers.items() if not p.in_use and a not in idle][:over]
        for address in idle:
            await self._close(address, self._peers.pop(address))

    def forget_transport(self, name: str) -> None:
        """The transport peer `name` was removed: every address naming it connects again at its next use."""
        for peer in self._peers.values():
            if peer.transport_name == name:
                peer.transport_name = None

    async def close(self) -> None:
        for address in list(self._peers):
            await self._close(address, self._peers.pop(address))

    async def _close(self, address: Address, peer: Peer) -> None:
        self.num_evicted += 1
        await peer.client.close()
        name = peer.transport_name
        if name is not None and all(p.transport_name != name for p in self._peers.values()):
            self._transport.remove_peer(name)
