"""The write-behind's process, for real: it writes the pages a batch names in the shared ring into block files a store
reads back, answers per block (a block it cannot write is that block's error, not the batch's), finds the files
another writer made instead of writing them again, exits when its pipe closes, a dead one is replaced, and it runs
below the node's priority."""

from __future__ import annotations

import os
import signal

import pytest

from hybridpd.engine.kv_offload.file_writer import Written
from hybridpd.engine.kv_offload.layout import GroupLayout
from hybridpd.engine.kv_offload.store import OffloadStore
from tests.unit.engine.kv_offload.conftest import SHARED_BYTES
from hybridpd.engine.kv_offload.helper_process import HelperGone, HelperSetup
from hybridpd.engine.kv_offload.writer_process import NICENESS, WriteBatch, WriterProcess

GROUPS = (GroupLayout(b"g" * 16, 64), GroupLayout(b"h" * 16, 128))


def setup_for(tmp_path) -> tuple[OffloadStore, HelperSetup]:
    store = OffloadStore(tmp_path, b"m" * 32, GROUPS, 1 << 20)
    return store, HelperSetup(str(store.folder), store.model_key, GROUPS, SHARED_BYTES)


def test_a_batch_is_written_where_a_store_reads_it(tmp_path, shared_buffer):
    fd, memory = shared_buffer
    memory[0:64] = b"a" * 64
    memory[64:192] = b"b" * 128
    memory[192:256] = b"c" * 64
    store, setup = setup_for(tmp_path)
    writer = WriterProcess(setup, fd)
    try:
        answer = writer.write(WriteBatch(((b"1" * 32, ((0, 0), (1, 64))), (b"2" * 32, ((0, 192),))), ()))
    finally:
        writer.close(5.0)
    assert answer.results == (Written(0b11, ()), Written(0b01, ()))
    assert answer.cpu_s > 0
    store.scan(full=True)
    assert bytes(store.read_many(b"1" * 32, (0, 1))[1]) == b"b" * 128
    assert bytes(store.read(0, b"2" * 32)) == b"c" * 64


def test_one_block_that_cannot_be_written_is_its_own_error_and_files_found_are_not_written_again(tmp_path, shared_buffer):
    fd, memory = shared_buffer
    memory[0:64] = b"a" * 64
    store, setup = setup_for(tmp_path)
    store.write(0, b"2" * 32, memoryview(b"a" * 64))       # another writer's file
    (store.folder / (b"3" * 32).hex()[:2]).touch()          # a file where the block's shard folder would go
    writer = WriterProcess(setup, fd)
    try:
        answer = writer.write(WriteBatch(tuple((h * 32, ((0, 0),)) for h in (b"1", b"2", b"3")), ()))
    finally:
        writer.close(5.0)
    written, found, failed = answer.results
    assert written == Written(0b01, ()) and found == Written(0, (0b01,))
    assert isinstance(failed, str) and "Error" in failed


def test_the_process_exits_when_closed_and_a_dead_one_is_replaced(tmp_path, shared_buffer):
    fd, memory = shared_buffer
    memory[0:64] = b"a" * 64
    _, setup = setup_for(tmp_path)
    writer = WriterProcess(setup, fd)
    batch = WriteBatch(((b"1" * 32, ((0, 0),)),), ())
    writer.write(batch)
    first = writer.pid
    os.kill(first, signal.SIGKILL)
    with pytest.raises(HelperGone):
        writer.write(WriteBatch(((b"2" * 32, ((0, 0),)),), ()))
    assert writer.pid is None
    assert writer.write(batch).results == (Written(0, (0b01,)),)   # a new process, which finds the first's file
    second = writer.pid
    assert second not in (None, first)
    writer.close(5.0)
    assert writer.pid is None
    with pytest.raises(ProcessLookupError):   # exited and reaped
        os.kill(second, 0)


def test_the_process_runs_below_the_nodes_priority_under_a_name_of_its_own(tmp_path, shared_buffer):
    fd, memory = shared_buffer
    _, setup = setup_for(tmp_path)
    writer = WriterProcess(setup, fd)
    try:
        writer.write(WriteBatch(((b"1" * 32, ((0, 0),)),), ()))
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, writer.pid) == min(19, ours + NICENESS)
        with open(f"/proc/{writer.pid}/comm") as comm:   # what top and ps show for it
            assert comm.read().strip() == "kv-writer"
    finally:
        writer.close(5.0)
