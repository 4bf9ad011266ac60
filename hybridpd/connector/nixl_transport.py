"""The real transport: NIXL (UCX backend) one-sided READs of whole blocks.

Descriptor lists are prepared once: one local list over our registered groups, one remote list per peer.
Group g's block b is descriptor `offsets[g] + b` in either list, so a request's READ is one
`make_prepped_xfer` over two index arrays (NIXL merges runs of adjacent blocks into larger copies).

Progress (measured on one host, 127.0.0.1): UCX picks cma (process_vm_readv) for the READ itself, but its
active messages go over tcp/lo (this UCX build has no shared-memory AM transport), and a READ does not
complete until the SOURCE has progressed its agent as well as the reader — also after the connection is up.
So with the progress thread off, the source side must call `get_notifs()` regularly (every ~1 ms while
reads may be in flight; it drives progress and returns the notifications), and the reader polls its handles.
NIXL's own progress thread (`progress_thread=True`) spins a full core (its Python API fixes the thread's
delay at 0), so on a 2-core host prefer polling; turn it on where a peer cannot poll (another host).

A node in both roles of a request (a proxy that lists it as prefiller and decoder) pulls from itself: NIXL refuses
to load an agent's own metadata, so for our own name the peer's descriptors are prepared over our own regions and
NIXL copies within the process (its loopback).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_prepped_dlist_handle, nixl_xfer_handle

from hybridpd.connector.transport import BlockRead, RegionLayout, TransferState, check_reads, layouts_of
from hybridpd.errors import KVTransferError

log = logging.getLogger(__name__)

_LOCAL = "NIXL_INIT_AGENT"
_STATES = {"DONE": TransferState.DONE, "PROC": TransferState.TRANSFERRING, "ERR": TransferState.FAILED}


def _descriptors(layouts: Sequence[RegionLayout]) -> tuple[np.ndarray, tuple[int, ...]]:
    """An (N, 3) array of (address, length, device 0), one row per block of every group, and group offsets."""
    rows, offsets, offset = [], [], 0
    for layout in layouts:
        block = np.arange(layout.num_blocks, dtype=np.uint64)
        addr = np.uint64(layout.base_addr) + block * np.uint64(layout.page_size_bytes)
        rows.append(np.stack([addr, np.full_like(addr, layout.page_size_bytes), np.zeros_like(addr)], axis=1))
        offsets.append(offset)
        offset += layout.num_blocks
    return np.concatenate(rows), tuple(offsets)


@dataclass(frozen=True, kw_only=True)
class _Peer:
    metadata: bytes
    layouts: tuple[RegionLayout, ...]
    offsets: tuple[int, ...]
    dlist: nixl_prepped_dlist_handle


@dataclass(frozen=True, kw_only=True)
class _Xfer:
    peer_name: str
    handle: nixl_xfer_handle | None  # None: nothing to move (an empty read) or posting failed
    posted_state: TransferState


class NixlTransport:
    def __init__(self, name: str, *, progress_thread: bool) -> None:
        self.name = name
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        self._agent = nixl_agent(name, config)
        self._tensors: tuple[torch.Tensor, ...] = ()
        self._layouts: tuple[RegionLayout, ...] = ()
        self._registered = None
        self._local_dlist: nixl_prepped_dlist_handle | None = None
        self._local_offsets: tuple[int, ...] = ()
        self._peers: dict[str, _Peer] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._done: dict[int, TransferState] = {}  # handles that reached a terminal state
        self._next_handle = 1
        self._closed = False

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        if self._tensors:
            raise RuntimeError(f"transport {self.name} already registered its KV cache")
        layouts = layouts_of(tensors)
        self._registered = self._agent.register_memory(list(tensors))
        descs, self._local_offsets = _descriptors(layouts)
        self._local_dlist = self._agent.prep_xfer_dlist(_LOCAL, descs, "DRAM")
        self._tensors, self._layouts = tuple(tensors), layouts

    def local_metadata(self) -> bytes:
        if not self._tensors:
            raise RuntimeError("register the KV cache before publishing transport metadata")
        return self._agent.get_agent_metadata()

    def local_layouts(self) -> tuple[RegionLayout, ...]:
        return self._layouts

    def add_peer(self, peer_name: str, metadata: bytes, layouts: Sequence[RegionLayout]) -> None:
        """Idempotent for the same metadata; a peer that restarted (new metadata) is replaced."""
        known = self._peers.get(peer_name)
        if known is not None and known.metadata == metadata and known.layouts == tuple(layouts):
            return
        if known is not None:
            self.remove_peer(peer_name)
        loopback = self._is_self(peer_name)
        if not loopback:
            self._load_agent(peer_name, metadata)
        try:
            descs, offsets = _descriptors(layouts)
            dlist = self._agent.prep_xfer_dlist(peer_name, descs, "DRAM")   # our own name: NIXL's loopback
        except Exception as e:
            if not loopback:
                self._agent.remove_remote_agent(peer_name)
            raise KVTransferError(peer_name, f"peer regions are not registered there ({type(e).__name__}: {e})") from e
        self._peers[peer_name] = _Peer(metadata=metadata, layouts=tuple(layouts), offsets=offsets, dlist=dlist)
        if loopback:
            return
        try:
            self._agent.make_connection(peer_name)  # start the wireup now rather than at the first read
        except Exception as e:
            log.warning("transport: early connection to %s failed (%s); the first read will retry", peer_name, e)

    def _is_self(self, peer_name: str) -> bool:
        """This node pulls what it prefilled itself (one node in both roles): NIXL's loopback, no remote agent."""
        return peer_name == self.name

    def _load_agent(self, peer_name: str, metadata: bytes) -> None:
        """The peer's agent loaded from its metadata (NIXL refuses to load its own: a loopback needs none)."""
        try:
            loaded = self._agent.add_remote_agent(metadata)
        except Exception as e:  # NIXL raises its own binding exceptions (nixlMismatchError, ...)
            raise KVTransferError(peer_name, f"bad transport metadata ({type(e).__name__}: {e})") from e
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != peer_name:
            self._agent.remove_remote_agent(loaded)
            raise KVTransferError(peer_name, f"transport metadata belongs to agent {loaded!r}")

    def remove_peer(self, peer_name: str) -> None:
        peer = self._peers.pop(peer_name, None)
        if peer is None:
            return
        for handle in [h for h, x in self._xfers.items() if x.peer_name == peer_name]:
            self._done[handle] = TransferState.FAILED
            self._release_xfer(self._xfers.pop(handle))
        peer.dlist.release()
        if self._is_self(peer_name):
            return
        try:
            self._agent.remove_remote_agent(peer_name)
        except Exception as e:
            log.warning("transport: removing peer %s: %s", peer_name, e)

    def start_read(self, peer_name: str, reads: Sequence[BlockRead], notif: bytes) -> int:
        peer = self._peers.get(peer_name)
        if peer is None:
            raise KVTransferError(peer_name, "unknown peer (add_peer first)")
        check_reads(peer_name, reads, self._layouts, peer.layouts)
        handle = self._next_handle
        self._next_handle += 1
        self._xfers[handle] = self._post(peer_name, peer, reads, notif)
        return handle

    def _post(self, peer_name: str, peer: _Peer, reads: Sequence[BlockRead], notif: bytes) -> _Xfer:
        try:
            if not reads:  # nothing to move: DONE at once, and no notification is sent
                return _Xfer(peer_name=peer_name, handle=None, posted_state=TransferState.DONE)
            local = np.fromiter((self._local_offsets[r.group_id] + r.local_block for r in reads), np.int32, len(reads))
            remote = np.fromiter((peer.offsets[r.group_id] + r.remote_block for r in reads), np.int32, len(reads))
            xfer = self._agent.make_prepped_xfer("READ", self._local_dlist, local, peer.dlist, remote, notif)
        except Exception as e:
            log.error("transport: READ from %s could not be prepared: %s: %s", peer_name, type(e).__name__, e)
            return _Xfer(peer_name=peer_name, handle=None, posted_state=TransferState.FAILED)
        try:
            state = _STATES[self._agent.transfer(xfer)]
        except Exception as e:
            log.error("transport: READ from %s could not be posted: %s: %s", peer_name, type(e).__name__, e)
            state = TransferState.FAILED
        return _Xfer(peer_name=peer_name, handle=xfer, posted_state=state)

    def poll(self, handle: int) -> TransferState:
        if handle in self._done:
            return self._done[handle]
        xfer = self._xfers[handle]
        state = xfer.posted_state
        if xfer.handle is not None and state is TransferState.TRANSFERRING:
            try:
                state = _STATES[self._agent.check_xfer_state(xfer.handle)]
            except Exception as e:
                log.error("transport: READ from %s failed: %s: %s", xfer.peer_name, type(e).__name__, e)
                state = TransferState.FAILED
        if state in (TransferState.DONE, TransferState.FAILED):
            self._done[handle] = state
        return state

    def release(self, handle: int) -> bool:
        """Frees the handle; a READ still in flight is cancelled (its local blocks hold undefined bytes). False
        when NIXL refuses to cancel it: the handle stays pollable until the READ ends."""
        xfer = self._xfers.get(handle)
        if xfer is not None and not self._release_xfer(xfer):
            return False
        self._done.pop(handle, None)
        self._xfers.pop(handle, None)
        return True

    def _release_xfer(self, xfer: _Xfer) -> bool:
        if xfer.handle is None:
            return True
        try:
            xfer.handle.release()
        except Exception as e:  # an in-flight READ that cannot be cancelled
            log.warning("transport: releasing a READ from %s: %s: %s", xfer.peer_name, type(e).__name__, e)
            return False
        return True

    def get_notifs(self) -> list[tuple[str, bytes]]:
        """Also drives this agent's progress (see the module docstring): call it every few ms on a source."""
        return [(str(peer), bytes(m)) for peer, msgs in self._agent.get_new_notifs().items() for m in msgs]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for handle in list(self._xfers):
            self.release(handle)
        for peer_name in list(self._peers):
            self.remove_peer(peer_name)
        if self._local_dlist is not None:
            self._local_dlist.release()
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
