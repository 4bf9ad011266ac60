"""The reads' process, for real and its batch in-process: the pages a batch wants land at their offsets of the shared
buffer (the others are read and checked, not placed), a read refreshes the file's time (the eviction order), the
batch stops at the first file that is missing or bad (and leaves a bad one for the store to remove), the kernel is
asked to read files ahead in order, and the process runs at the node's priority under a name of its own, exits when
closed and is replaced when it died."""

from __future__ import annotations

import os
import signal

import pytest

from hybridpd.engine.kv_offload.file_reader import ReadOutcome
from hybridpd.engine.kv_offload.helper_process import HelperGone, HelperSetup
from hybridpd.engine.kv_offload.layout import GroupLayout
from hybridpd.engine.kv_offload.reader_process import (
    PREFETCH,
    FileToRead,
    ReadBatch,
    ReaderProcess,
    read_batch,
)
from hybridpd.engine.kv_offload.store import OffloadStore
from tests.unit.engine.kv_offload.conftest import SHARED_BYTES

GROUPS = (GroupLayout(b"g" * 16, 64), GroupLayout(b"h" * 16, 128))


def written(tmp_path, blocks: int = 2) -> tuple[OffloadStore, HelperSetup]:
    """Block i (hash bytes([i]) * 32): a file of both groups, pages of byte i and i + 100."""
    store = OffloadStore(tmp_path, b"m" * 32, GROUPS, 1 << 20)
    store.write_many([(bytes([i]) * 32, [(0, memoryview(bytes([i]) * 64)), (1, memoryview(bytes([i + 100]) * 128))])
                      for i in range(blocks)])
    return store, HelperSetup(str(store.folder), store.model_key, GROUPS, SHARED_BYTES)


def test_the_wanted_pages_land_at_their_offsets_and_a_read_refreshes_the_files_time(tmp_path):
    store, setup = written(tmp_path)
    path = store.path(0, b"\0" * 32)
    os.utime(path, (1_000_000, 1_000_000))
    buffer = memoryview(bytearray(SHARED_BYTES))
    batch = ReadBatch((FileToRead(b"\0" * 32, 0b11, (0, 64)), FileToRead(b"\1" * 32, 0b11, (None, 192))))
    assert read_batch(setup, batch, buffer) == (ReadOutcome.READ, ReadOutcome.READ)
    assert bytes(buffer[:64]) == b"\0" * 64 and bytes(buffer[64:192]) == bytes([100]) * 128
    assert bytes(buffer[192:320]) == bytes([101]) * 128 and bytes(buffer[320:]) == bytes(SHARED_BYTES - 320)
    assert path.stat().st_mtime > 1_000_000


@pytest.mark.parametrize("damage, outcome", [
    ("remove", ReadOutcome.MISSING),
    ("truncate", ReadOutcome.BAD),
    ("longer", ReadOutcome.BAD),
    ("flip a byte", ReadOutcome.BAD),
    ("another model", ReadOutcome.BAD),
])
def test_a_batch_stops_at_the_first_file_it_cannot_use(tmp_path, damage, outcome):
    store, setup = written(tmp_path, blocks=3)
    path = store.path(0, b"\1" * 32)
    data = path.read_bytes()
    if damage == "remove":
        path.unlink()
    elif damage == "truncate":
        path.write_bytes(data[:-1])
    elif damage == "longer":
        path.write_bytes(data + b"\0")
    elif damage == "flip a byte":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    else:
        path.write_bytes(data[:8 + 4] + b"o" * 32 + data[8 + 4 + 32:])
    files = tuple(FileToRead(bytes([i]) * 32, 0b11, (i * 192, i * 192 + 64)) for i in range(3))
    assert read_batch(setup, ReadBatch(files), memoryview(bytearray(SHARED_BYTES))) == (ReadOutcome.READ, outcome)
    assert path.exists() == (damage != "remove")   # a bad file is the store's to remove


def test_the_kernel_is_asked_for_files_ahead_in_order_each_once(tmp_path, monkeypatch):
    count = PREFETCH + 3
    store, setup = written(tmp_path, blocks=count)
    advised, read = [], []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: advised.append(
        (os.readlink(f"/proc/self/fd/{fd}"), advice)))
    real_readv = os.readv

    def readv(fd, buffers):
        read.append((os.readlink(f"/proc/self/fd/{fd}"), len(advised)))
        return real_readv(fd, buffers)

    monkeypatch.setattr(os, "readv", readv)
    files = tuple(FileToRead(bytes([i]) * 32, 0b11, (None, None)) for i in range(count))
    assert read_batch(setup, ReadBatch(files), memoryview(bytearray(SHARED_BYTES))) == (ReadOutcome.READ,) * count
    paths = [str(store.path(0, bytes([i]) * 32)) for i in range(count)]
    assert advised == [(path, os.POSIX_FADV_WILLNEED) for path in paths]
    # file i is read once the kernel was asked for the PREFETCH files after it (or all there are)
    assert read == [(path, min(count, i + 1 + PREFETCH)) for i, path in enumerate(paths)]


def test_the_process_reads_into_the_shared_buffer_at_the_nodes_priority_and_is_replaced_when_it_died(
        tmp_path, shared_buffer):
    fd, memory = shared_buffer
    _, setup = written(tmp_path)
    reader = ReaderProcess(setup, fd)
    reader.start()
    first = reader.pid
    try:
        answer = reader.call(ReadBatch((FileToRead(b"\1" * 32, 0b11, (128, 0)),)))
        assert answer.outcomes == (ReadOutcome.READ,) and answer.cpu_s > 0
        assert os.getpriority(os.PRIO_PROCESS, first) == os.getpriority(os.PRIO_PROCESS, 0)
        with open(f"/proc/{first}/comm") as comm:   # what top and ps show for it
            assert comm.read().strip() == "kv-reader"
        assert memory[128:192] == b"\1" * 64 and memory[0:128] == bytes([101]) * 128
        os.kill(first, signal.SIGKILL)
        with pytest.raises(HelperGone):
            reader.call(ReadBatch((FileToRead(b"\0" * 32, 0b11, (0, None)),)))
        assert reader.pid is None
        assert reader.call(ReadBatch((FileToRead(b"\0" * 32, 0b11, (0, None)),))).outcomes == (ReadOutcome.READ,)
        second = reader.pid
        assert second not in (None, first) and memory[0:64] == b"\0" * 64
    finally:
        reader.close(5.0)
    assert reader.pid is None
    with pytest.raises(ProcessLookupError):   # exited and reaped
        os.kill(second, 0)
