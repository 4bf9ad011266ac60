"""The real NIXL transport between two processes on 127.0.0.1: the source stays idle while we READ."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridpd.connector.nixl_transport import NixlTransport
from hybridpd.connector.transport import BlockRead, RegionLayout, TransferState
from hybridpd.errors import KVTransferError

SOURCE = Path(__file__).with_name("nixl_source_node.py")
REPO = Path(__file__).resolve().parents[3]
SHAPES = [(48, 4096), (8, 12288)]  # (num_blocks, page_size_bytes) of an attention group and a Mamba-like group
SEED = 7


class Source:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        hello = json.loads(self._line())
        self.metadata = base64.b64decode(hello["metadata"])
        self.layouts = [RegionLayout(base_addr=a, page_size_bytes=p, num_blocks=n) for a, p, n in hello["layouts"]]

    def _line(self) -> str:
        """The next `@@ {json}` reply line; NIXL's own log lines on stdout are skipped."""
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                return line[3:]
        raise RuntimeError(f"source exited: {self.proc.stderr.read()[-2000:]}")

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def collected(self) -> list[tuple[str, bytes]]:
        return [(peer, msg.encode()) for peer, msg in json.loads(self._line())]


@pytest.fixture
def source() -> Iterator[Source]:
    args = [f"{p}:{n}" for n, p in SHAPES]
    proc = subprocess.Popen(
        [sys.executable, str(SOURCE), "src", str(SEED), *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )
    try:
        yield Source(proc)
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def reader() -> Iterator[tuple[NixlTransport, list[torch.Tensor]]]:
    torch.set_num_threads(1)
    tensors = [torch.from_numpy(np.zeros(shape, dtype=np.int8)) for shape in SHAPES]
    transport = NixlTransport("dst", progress_thread=False)
    transport.register(tensors)
    try:
        yield transport, tensors
    finally:
        transport.close()


def wait_done(transport: NixlTransport, handle: int, deadline_s: float = 20.0) -> TransferState:
    deadline = time.monotonic() + deadline_s
    state = transport.poll(handle)
    while state in (TransferState.PENDING, TransferState.TRANSFERRING) and time.monotonic() < deadline:
        state = transport.poll(handle)
    return state


READS = [BlockRead(group_id=0, remote_block=r, local_block=l) for r, l in [(5, 1), (6, 2), (7, 3), (40, 47), (2, 9)]]
READS += [BlockRead(group_id=1, remote_block=r, local_block=l) for r, l in [(3, 0), (7, 5)]]


def assert_read_landed(tensors: list[torch.Tensor]) -> None:
    rng = np.random.default_rng(SEED)
    expected = [torch.from_numpy(rng.integers(-128, 128, size=s, dtype=np.int8)) for s in SHAPES]
    for r in READS:
        assert torch.equal(tensors[r.group_id][r.local_block], expected[r.group_id][r.remote_block]), r
    untouched = [b for b in range(SHAPES[0][0]) if b not in {r.local_block for r in READS if r.group_id == 0}]
    assert not tensors[0][untouched].any()


def test_read_scattered_blocks_of_two_groups_while_the_source_polls(source, reader) -> None:
    transport, tensors = reader
    transport.add_peer("src", source.metadata, source.layouts)
    transport.add_peer("src", source.metadata, source.layouts)  # idempotent
    source.send("collect 1")  # the source drives its agent (get_notifs) until our notification arrives
    handle = transport.start_read("src", READS, b"req-1")
    assert wait_done(transport, handle) is TransferState.DONE
    transport.release(handle)
    assert source.collected() == [("dst", b"req-1")]
    assert_read_landed(tensors)


def test_a_read_from_an_idle_source_completes_once_the_source_polls(source, reader) -> None:
    """Measured here (UCX on one host, AM over tcp/lo): a READ needs the source to progress its agent.

    The source is blocked on stdin (idle) while we start and poll the READ; the bytes land once it polls.
    """
    transport, tensors = reader
    transport.add_peer("src", source.metadata, source.layouts)
    handle = transport.start_read("src", READS, b"req-idle")
    wait_done(transport, handle, deadline_s=0.2)  # whatever the state: the source has not helped yet
    source.send("collect 1")
    assert wait_done(transport, handle) is TransferState.DONE
    assert source.collected() == [("dst", b"req-idle")]
    assert_read_landed(tensors)


def test_a_node_reads_its_own_blocks_through_the_loopback(reader) -> None:
    """One node in both roles of a request: it pulls what its own prefill holds. NIXL refuses to load an agent's
    own metadata, so the transport prepares its own regions as the peer's instead (NIXL's loopback)."""
    transport, tensors = reader
    tensors[0][5] = 3
    tensors[1][2] = -4
    transport.add_peer("dst", transport.local_metadata(), transport.local_layouts())
    transport.add_peer("dst", transport.local_metadata(), transport.local_layouts())  # idempotent
    reads = [BlockRead(group_id=0, remote_block=5, local_block=9), BlockRead(group_id=1, remote_block=2, local_block=6)]
    handle = transport.start_read("dst", reads, b"self")
    assert wait_done(transport, handle) is TransferState.DONE
    transport.release(handle)
    assert (tensors[0][9] == 3).all() and (tensors[1][6] == -4).all()
    assert not tensors[0][[b for b in range(SHAPES[0][0]) if b not in (5, 9)]].any()
    transport.remove_peer("dst")
    with pytest.raises(KVTransferError, match="unknown peer"):
        transport.start_read("dst", reads, b"gone")


def test_an_empty_read_is_done_at_once(source, reader) -> None:
    transport, tensors = reader
    transport.add_peer("src", source.metadata, source.layouts)
    assert transport.poll(transport.start_read("src", [], b"nothing-to-pull")) is TransferState.DONE
    assert not any(t.any() for t in tensors)


@pytest.mark.parametrize(
    "metadata, layouts, reason",
    [
        (b"garbage", [RegionLayout(base_addr=4096, page_size_bytes=4096, num_blocks=1)], "bad transport metadata"),
        (b"", [RegionLayout(base_addr=4096, page_size_bytes=4096, num_blocks=1)], "bad transport metadata"),
    ],
)
def test_add_peer_with_bad_metadata_raises(reader, metadata: bytes, layouts, reason: str) -> None:
    transport, _ = reader
    with pytest.raises(KVTransferError, match=reason) as info:
        transport.add_peer("ghost", metadata, layouts)
    assert info.value.peer == "ghost"


@pytest.mark.parametrize(
    "read, reason",
    [
        (BlockRead(group_id=0, remote_block=48, local_block=0), "remote block 48 of group 0 is out of range"),
        (BlockRead(group_id=1, remote_block=0, local_block=8), "local block 8 of group 1 is out of range"),
        (BlockRead(group_id=2, remote_block=0, local_block=0), "read names group 2"),
    ],
)
def test_out_of_range_reads_are_rejected_before_any_byte_moves(source, reader, read: BlockRead, reason: str) -> None:
    transport, _ = reader
    transport.add_peer("src", source.metadata, source.layouts)
    with pytest.raises(KVTransferError, match=reason):
        transport.start_read("src", [read], b"x")


def test_unknown_peer_raises(reader) -> None:
    transport, _ = reader
    with pytest.raises(KVTransferError, match="unknown peer"):
        transport.start_read("nobody", [BlockRead(group_id=0, remote_block=0, local_block=0)], b"x")
