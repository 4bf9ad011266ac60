"""The in-process fake transport behaves like the real one: READs, notifications, failures, stalls."""

from __future__ import annotations

import pytest
import torch

from hybridpd.connector.fake_transport import FakeFabric, FakeTransport
from hybridpd.connector.transport import BlockRead, TransferState
from hybridpd.errors import KVTransferError

SHAPES = [(8, 64), (4, 128)]


def node(name: str, fabric: FakeFabric, fill: int | None) -> tuple[FakeTransport, list[torch.Tensor]]:
    tensors = [torch.zeros(s, dtype=torch.int8) for s in SHAPES]
    if fill is not None:
        for gid, t in enumerate(tensors):
            t.copy_(torch.arange(t.numel(), dtype=torch.int64).add(fill + gid).remainder(127).view(t.shape))
    transport = FakeTransport(name, fabric)
    transport.register(tensors)
    return transport, tensors


@pytest.fixture
def pair():
    fabric = FakeFabric()
    src, src_tensors = node("src", fabric, fill=3)
    dst, dst_tensors = node("dst", fabric, fill=None)
    dst.add_peer("src", src.local_metadata(), src.local_layouts())
    return fabric, src, src_tensors, dst, dst_tensors


READS = [BlockRead(group_id=0, remote_block=5, local_block=1), BlockRead(group_id=0, remote_block=2, local_block=7),
         BlockRead(group_id=1, remote_block=3, local_block=0)]


def test_read_copies_blocks_and_notifies_the_source(pair) -> None:
    _, src, src_tensors, dst, dst_tensors = pair
    handle = dst.start_read("src", READS, b"req-1")
    assert dst.poll(handle) is TransferState.DONE
    for r in READS:
        assert torch.equal(dst_tensors[r.group_id][r.local_block], src_tensors[r.group_id][r.remote_block])
    assert not dst_tensors[0][[0, 2, 3, 4, 5, 6]].any()
    assert src.get_notifs() == [("dst", b"req-1")]
    assert src.get_notifs() == []
    dst.release(handle)


@pytest.mark.parametrize(
    "fault, first, after_clearing",
    [("fail", TransferState.FAILED, TransferState.FAILED), ("stall", TransferState.TRANSFERRING, TransferState.DONE)],
)
def test_faults(pair, fault: str, first: TransferState, after_clearing: TransferState) -> None:
    fabric, src, _, dst, _ = pair
    setter = fabric.set_failing if fault == "fail" else fabric.set_stalled
    setter("src")
    handle = dst.start_read("src", READS, b"req-1")
    assert dst.poll(handle) is first
    setter("src", False)
    assert dst.poll(handle) is after_clearing
    assert src.get_notifs() == ([("dst", b"req-1")] if after_clearing is TransferState.DONE else [])


@pytest.mark.parametrize(
    "metadata, reason",
    [(b"fake:other", "bad transport metadata"), (b"garbage", "bad transport metadata")],
)
def test_add_peer_rejects_bad_metadata(metadata: bytes, reason: str) -> None:
    fabric = FakeFabric()
    src, _ = node("src", fabric, fill=1)
    dst, _ = node("dst", fabric, fill=None)
    with pytest.raises(KVTransferError, match=reason):
        dst.add_peer("src", metadata, src.local_layouts())


@pytest.mark.parametrize(
    "read, reason",
    [
        (BlockRead(group_id=0, remote_block=8, local_block=0), "remote block 8 of group 0 is out of range"),
        (BlockRead(group_id=1, remote_block=0, local_block=-1), "local block -1 of group 1 is out of range"),
        (BlockRead(group_id=5, remote_block=0, local_block=0), "read names group 5"),
    ],
)
def test_out_of_range_reads_raise(pair, read: BlockRead, reason: str) -> None:
    _, _, _, dst, _ = pair
    with pytest.raises(KVTransferError, match=reason):
        dst.start_read("src", [read], b"x")


def test_a_removed_peer_fails_its_pending_reads_and_unknown_peers_raise(pair) -> None:
    _, _, _, dst, _ = pair
    handle = dst.start_read("src", READS, b"req-1")
    dst.remove_peer("src")
    assert dst.poll(handle) is TransferState.FAILED
    with pytest.raises(KVTransferError, match="unknown peer"):
        dst.start_read("src", READS, b"req-2")


def test_an_empty_read_is_done_at_once_and_notifies_no_one(pair) -> None:
    _, src, _, dst, _ = pair
    assert dst.poll(dst.start_read("src", [], b"nothing")) is TransferState.DONE
    assert src.get_notifs() == []
