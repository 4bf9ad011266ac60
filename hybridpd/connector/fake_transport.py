"""An in-process transport for unit tests: peers are other FakeTransports attached to one FakeFabric.

A READ copies the bytes when the reader first polls it (so a test can observe PENDING), then sends the
notification to the peer. The fabric can make a peer fail (every read from it FAILS) or stall (reads from it
stay TRANSFERRING until the stall is lifted), and make its reads uncancellable (`release` of one still running
returns False and the READ goes on, as NIXL may refuse to cancel).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridpd.connector.transport import BlockRead, RegionLayout, TransferState, check_reads, layouts_of
from hybridpd.errors import KVTransferError


class FakeFabric:
    def __init__(self) -> None:
        self._nodes: dict[str, FakeTransport] = {}
        self._failing: set[str] = set()
        self._stalled: set[str] = set()
        self._uncancellable: set[str] = set()

    def attach(self, transport: FakeTransport) -> None:
        if transport.name in self._nodes:
            raise ValueError(f"a transport named {transport.name!r} is already attached")
        self._nodes[transport.name] = transport

    def detach(self, name: str) -> None:
        self._nodes.pop(name, None)

    def node(self, name: str) -> FakeTransport | None:
        return self._nodes.get(name)

    def set_failing(self, name: str, failing: bool = True) -> None:
        (self._failing.add if failing else self._failing.discard)(name)

    def set_stalled(self, name: str, stalled: bool = True) -> None:
        (self._stalled.add if stalled else self._stalled.discard)(name)

    def set_uncancellable(self, name: str, uncancellable: bool = True) -> None:
        (self._uncancellable.add if uncancellable else self._uncancellable.discard)(name)

    def is_uncancellable(self, name: str) -> bool:
        return name in self._uncancellable

    def is_failing(self, name: str) -> bool:
        return name in self._failing

    def is_stalled(self, name: str) -> bool:
        return name in self._stalled


@dataclass(frozen=True, kw_only=True)
class _Read:
    peer_name: str
    reads: tuple[BlockRead, ...]
    notif: bytes


class FakeTransport:
    def __init__(self, name: str, fabric: FakeFabric) -> None:
        self.name = name
        self._fabric = fabric
        self._tensors: tuple[torch.Tensor, ...] = ()
        self._layouts: tuple[RegionLayout, ...] = ()
        self._peers: dict[str, tuple[RegionLayout, ...]] = {}
        self._reads: dict[int, _Read] = {}
        self._states: dict[int, TransferState] = {}
        self._next_handle = 1
        self._inbox: list[tuple[str, bytes]] = []
        fabric.attach(self)

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        if self._tensors:
            raise RuntimeError(f"transport {self.name} already registered its KV cache")
        self._layouts = layouts_of(tensors)
        self._tensors = tuple(tensors)

    def local_metadata(self) -> bytes:
        return b"fake:" + self.name.encode()

    def local_layouts(self) -> tuple[RegionLayout, ...]:
        return self._layouts

    def add_peer(self, peer_name: str, metadata: bytes, layouts: Sequence[RegionLayout]) -> None:
        peer = self._fabric.node(peer_name)
        if metadata != b"fake:" + peer_name.encode() or peer is None:
            raise KVTransferError(peer_name, "bad transport metadata (no such fake peer)")
        if tuple(layouts) != peer.local_layouts():
            raise KVTransferError(peer_name, "published layouts disagree with the peer's registered regions")
        self._peers[peer_name] = tuple(layouts)

    def remove_peer(self, peer_name: str) -> None:
        self._peers.pop(peer_name, None)
        for handle, read in self._reads.items():
            if read.peer_name == peer_name and self._states[handle] is not TransferState.DONE:
                self._states[handle] = TransferState.FAILED

    def start_read(self, peer_name: str, reads: Sequence[BlockRead], notif: bytes) -> int:
        if peer_name not in self._peers:
            raise KVTransferError(peer_name, "unknown peer (add_peer first)")
        check_reads(peer_name, reads, self._layouts, self._peers[peer_name])
        handle = self._next_handle
        self._next_handle += 1
        self._reads[handle] = _Read(peer_name=peer_name, reads=tuple(reads), notif=notif)
        self._states[handle] = TransferState.PENDING
        return handle

    def poll(self, handle: int) -> TransferState:
        state = self._states[handle]
        if state in (TransferState.DONE, TransferState.FAILED):
            return state
        read = self._reads[handle]
        peer = self._fabric.node(read.peer_name)
        if peer is None or self._fabric.is_failing(read.peer_name):
            state = TransferState.FAILED
        elif self._fabric.is_stalled(read.peer_name):
            state = TransferState.TRANSFERRING
        else:
            for r in read.reads:
                self._tensors[r.group_id][r.local_block].copy_(peer._tensors[r.group_id][r.remote_block])
            if read.reads:
                peer._inbox.append((self.name, read.notif))
            state = TransferState.DONE
        self._states[handle] = state
        return state

    def release(self, handle: int) -> bool:
        read, state = self._reads.get(handle), self._states.get(handle)
        if (read is not None and state not in (TransferState.DONE, TransferState.FAILED)
                and self._fabric.is_uncancellable(read.peer_name)):
            return False
        self._reads.pop(handle, None)
        self._states.pop(handle, None)
        return True

    def num_running(self) -> int:
        """READs started and not yet ended, failed or cancelled: they may still write into local blocks."""
        return sum(state in (TransferState.PENDING, TransferState.TRANSFERRING) for state in self._states.values())

    def get_notifs(self) -> list[tuple[str, bytes]]:
        notifs, self._inbox = self._inbox, []
        return notifs

    def close(self) -> None:
        self._reads.clear()
        self._states.clear()
        self._peers.clear()
        self._fabric.detach(self.name)
