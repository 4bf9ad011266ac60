"""The transport: one-sided READs of whole blocks from a peer's registered group tensors into ours.

It knows bytes, regions and peers, never requests. A node registers its canonical KV cache once (one
`(num_blocks, page_size_bytes)` int8 tensor per group, `hybridpd.engine.kv_cache.storage`), publishes
`local_metadata()` and `local_layouts()` over the side channel, and a reader that has added the peer moves
any batch of blocks with `start_read` then `poll`s the handle until DONE or FAILED. The notification passed to
`start_read` reaches the peer (its `get_notifs()`) once the READ has completed. An empty batch is DONE at
once and notifies no one. The source side calls `get_notifs()` regularly: for NIXL on one host that is also
what lets a READ from it progress (see nixl_transport.py).

Implementations: `NixlTransport` (NIXL/UCX, the real one) and `FakeTransport` (in-process, for unit tests).
Neither is thread-safe: call one transport from one thread.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from hybridpd.errors import KVTransferError


@dataclass(frozen=True, kw_only=True)
class RegionLayout:
    """One group's registered region: block b lives at `base_addr + b * page_size_bytes`."""

    base_addr: int
    page_size_bytes: int
    num_blocks: int

    def __post_init__(self) -> None:
        if self.base_addr < 0 or self.page_size_bytes < 1 or self.num_blocks < 1:
            raise ValueError(f"invalid region layout: {self}")


@dataclass(frozen=True, kw_only=True)
class BlockRead:
    """Copy the peer's block `remote_block` of group `group_id` into our block `local_block` of that group."""

    group_id: int
    remote_block: int
    local_block: int


class TransferState(enum.Enum):
    PENDING = "pending"            # accepted, not started yet
    TRANSFERRING = "transferring"  # bytes are moving
    DONE = "done"                  # every block arrived and the notification was sent
    FAILED = "failed"              # the READ failed; the local blocks hold undefined bytes


class Transport(Protocol):
    name: str

    def register(self, tensors: Sequence[torch.Tensor]) -> None: ...

    def local_metadata(self) -> bytes: ...

    def local_layouts(self) -> tuple[RegionLayout, ...]: ...

    def add_peer(self, peer_name: str, metadata: bytes, layouts: Sequence[RegionLayout]) -> None: ...

    def remove_peer(self, peer_name: str) -> None: ...

    def start_read(self, peer_name: str, reads: Sequence[BlockRead], notif: bytes) -> int: ...

    def poll(self, handle: int) -> TransferState: ...

    def release(self, handle: int) -> bool:
        """Free the handle. True once the READ can no longer write into our blocks (it finished, failed or was
        cancelled); False when an in-flight READ could not be cancelled: then keep polling the handle until it
        ends, and release it again."""
        ...

    def get_notifs(self) -> list[tuple[str, bytes]]: ...

    def close(self) -> None: ...


def layouts_of(tensors: Sequence[torch.Tensor]) -> tuple[RegionLayout, ...]:
    """The layouts of a node's group tensors; rejects anything that is not a contiguous 2-D int8 CPU tensor."""
    layouts = []
    for gid, t in enumerate(tensors):
        if t.dtype != torch.int8 or t.dim() != 2 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(
                f"group {gid}: expected a contiguous (num_blocks, page_size_bytes) int8 CPU tensor, "
                f"got {tuple(t.shape)} {t.dtype} on {t.device}"
            )
        layouts.append(RegionLayout(base_addr=t.data_ptr(), page_size_bytes=t.shape[1], num_blocks=t.shape[0]))
    return tuple(layouts)


def check_reads(
    peer_name: str,
    reads: Sequence[BlockRead],
    local: Sequence[RegionLayout],
    remote: Sequence[RegionLayout],
) -> None:
    """Raises KVTransferError naming the first read that falls outside either side's regions.

    Block ids come from the wire (`remote_block_ids`), so they are checked here, before any byte moves.
    """
    if len(local) != len(remote):
        raise KVTransferError(peer_name, f"peer has {len(remote)} KV groups, this node has {len(local)}")
    for gid, (mine, theirs) in enumerate(zip(local, remote)):
        if mine.page_size_bytes != theirs.page_size_bytes:
            raise KVTransferError(
                peer_name,
                f"group {gid} page size differs: local {mine.page_size_bytes}, remote {theirs.page_size_bytes}",
            )
    for r in reads:
        if not 0 <= r.group_id < len(local):
            raise KVTransferError(peer_name, f"read names group {r.group_id}, there are {len(local)} groups")
        if not 0 <= r.remote_block < remote[r.group_id].num_blocks:
            raise KVTransferError(
                peer_name,
                f"remote block {r.remote_block} of group {r.group_id} is out of range "
                f"(the peer has {remote[r.group_id].num_blocks} blocks)",
            )
        if not 0 <= r.local_block < local[r.group_id].num_blocks:
            raise KVTransferError(
                peer_name,
                f"local block {r.local_block} of group {r.group_id} is out of range "
                f"(this node has {local[r.group_id].num_blocks} blocks)",
            )
