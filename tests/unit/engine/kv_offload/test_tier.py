"""The tier's queues: a write-behind that is full drops (and counts) rather than waits, and a writer process that
dies costs the batch it had and no more; a load copies whole pages
into the blocks it was given, and one missing file fails the load and is forgotten (so the next hit search no
longer counts on it), one larger than the read buffer goes in batches, and a bad file fails it and goes; a load whose
read hangs (its reader process stopped) is abandoned, offers no hits meanwhile, and copies nothing once the read
returns; closing the tier ends a reader that hangs."""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager, suppress

import pytest
import torch

from hybridpd.engine.kv_offload.layout import GroupLayout
from hybridpd.engine.kv_offload.store import OffloadStore
from hybridpd.engine.kv_offload.tier import LoadItem, OffloadTier

PAGE = 32


def make(tmp_path, queue_pages=8):
    store = OffloadStore(tmp_path, b"m" * 32, (GroupLayout(b"g" * 16, PAGE),), 1 << 20)
    pages = torch.arange(4 * PAGE, dtype=torch.int64).remainder(100).to(torch.int8).view(4, PAGE)
    return store, pages, OffloadTier(store, [pages], queue_bytes=queue_pages * PAGE, rescan_s=3600)


HANG_S = 120.0   # a wait longer than this is a hang: the test fails with what it waited for, never stalls the suite


def wait_loaded(tier: OffloadTier) -> list[tuple[str, bool]]:
    done = []
    deadline = time.monotonic() + HANG_S
    while not done:
        assert time.monotonic() < deadline, "no load finished"
        tier.wait_for_load(0.1)
        done = tier.take_finished()
    return done


def retried(call):
    """`call()`, again every 10 ms while it fails with OSError (a FIFO without a reader yet)."""
    deadline = time.monotonic() + HANG_S
    while True:
        try:
            return call()
        except OSError:
            assert time.monotonic() < deadline, "the FIFO never had a reader"
            time.sleep(0.01)


@contextmanager
def writer_stopped(tier: OffloadTier):
    """The tier's writer process stopped (SIGSTOP) while the block runs; it runs once a first write has started it."""
    tier.offer([(0, b"w" * 32, 3)])
    assert tier.wait_written(30) and tier.writer_pid is not None
    pid = tier.writer_pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        with suppress(ProcessLookupError):   # killed (and reaped) by the test
            os.kill(pid, signal.SIGCONT)


def test_a_full_write_queue_drops_and_counts(tmp_path):
    _, _, tier = make(tmp_path, queue_pages=1)
    with writer_stopped(tier):
        for i in range(4):
            tier.offer([(0, bytes([i]) * 32, i)])
        assert tier.counters.dropped_queue_full == 3   # the first is with the writer (its ring range still taken)
        tier.offer([(0, bytes([9]) * 32, 0), (0, bytes([8]) * 32, 1)])
        assert tier.counters.dropped_queue_full == 5
    tier.close()
    assert tier.counters.written == 2 and tier.counters.dropped_queue_full == 5
    assert tier.has(0, bytes([0]) * 32) and not tier.has(0, bytes([1]) * 32)
    assert tier.counters.writer_cpu_s > 0   # the writer process's CPU and its thread's, counted as they go


def test_a_page_offered_twice_is_written_once_and_a_writer_that_dies_costs_its_batch_only(tmp_path):
    _, _, tier = make(tmp_path)
    with writer_stopped(tier) as pid:
        tier.offer([(0, b"a" * 32, 1), (0, b"b" * 32, 2)])                # the batch the writer dies with
        os.kill(pid, signal.SIGKILL)
        assert tier.wait_written(30)
    assert tier.counters.dropped_write_error == 2
    tier.offer([(0, b"c" * 32, 1), (0, b"c" * 32, 1), (0, b"d" * 32, 3)])   # a new writer process
    tier.close()
    assert tier.writer_pid != pid
    assert tier.counters.dropped_write_error == 2 and tier.counters.written == 3
    assert tier.has(0, b"c" * 32) and tier.has(0, b"d" * 32) and not tier.has(0, b"a" * 32)


def test_a_load_copies_pages_and_a_missing_file_fails_it(tmp_path):
    store, pages, tier = make(tmp_path)
    original = pages.clone()
    tier.offer([(0, b"a" * 32, 1), (0, b"b" * 32, 2)])
    tier.close()   # flushes the writes
    assert tier.has(0, b"a" * 32) and tier.has(0, b"b" * 32)

    _, pages, reader = make(tmp_path)
    pages.zero_()
    reader.start_load("r1", [LoadItem(0, 3, b"a" * 32), LoadItem(0, 0, b"b" * 32)])
    assert wait_loaded(reader) == [("r1", True)]
    assert torch.equal(pages[3], original[1]) and torch.equal(pages[0], original[2])

    store.path(0, b"b" * 32).unlink()   # evicted by another node since the last scan
    reader.start_load("r2", [LoadItem(0, 1, b"b" * 32)])
    assert wait_loaded(reader) == [("r2", False)]
    assert not reader.has(0, b"b" * 32) and reader.counters.load_misses == 1
    reader.close()


def test_the_pages_a_step_offers_for_one_hash_share_a_file_and_load_into_each_groups_blocks(tmp_path):
    layouts = (GroupLayout(b"g" * 16, PAGE), GroupLayout(b"h" * 16, 2 * PAGE))

    def two_groups():
        store = OffloadStore(tmp_path, b"m" * 32, layouts, 1 << 20)
        pages = [torch.arange(4 * layout.page_bytes).remainder(90 + g).to(torch.int8).view(4, layout.page_bytes)
                 for g, layout in enumerate(layouts)]
        return store, pages, OffloadTier(store, pages, rescan_s=3600)

    store, pages, tier = two_groups()
    original = [p.clone() for p in pages]
    tier.offer([(0, b"a" * 32, 1), (1, b"a" * 32, 3), (0, b"b" * 32, 2)])
    tier.close()
    assert sorted(p.name for p in store.folder.rglob("*.kv")) == [f"{(b'a' * 32).hex()}.3.kv",
                                                                   f"{(b'b' * 32).hex()}.1.kv"]
    assert tier.counters.written == 3   # pages, as the metric counts them

    _, pages, reader = two_groups()
    for p in pages:
        p.zero_()
    reader.start_load("r", [LoadItem(1, 0, b"a" * 32), LoadItem(0, 2, b"b" * 32), LoadItem(0, 3, b"a" * 32)])
    assert wait_loaded(reader) == [("r", True)]
    assert torch.equal(pages[1][0], original[1][3]) and torch.equal(pages[0][3], original[0][1])
    assert torch.equal(pages[0][2], original[0][2]) and reader.counters.loaded_blocks == 3
    reader.close()


def test_a_read_that_hangs_is_abandoned_and_never_writes_into_the_blocks_after(tmp_path):
    store, _, tier = make(tmp_path)
    tier.offer([(0, b"a" * 32, 1), (0, b"b" * 32, 2)])
    tier.close()
    path = store.path(0, b"a" * 32)
    data = path.read_bytes()
    path.unlink()
    os.mkfifo(path)   # its read waits for a writer, then for the bytes: an NFS server gone, until it comes back

    _, pages, reader = make(tmp_path)
    pages.fill_(7)
    reader.start_load("stuck", [LoadItem(0, 0, b"a" * 32), LoadItem(0, 3, b"b" * 32)])
    reader.start_load("queued", [LoadItem(0, 2, b"b" * 32)])
    fifo = retried(lambda: os.open(path, os.O_WRONLY | os.O_NONBLOCK))   # once the reader process opened it
    try:
        try:
            assert reader.abandon_overdue(3600) == []   # not overdue yet
            assert reader.has(0, b"b" * 32)
            assert sorted(reader.abandon_overdue(0)) == ["queued", "stuck"]
            assert not reader.loading and reader.counters.load_timeouts == 2
            assert not reader.has(0, b"b" * 32)   # no hit is offered while the loader is stuck
        finally:
            # The read returns the file whole: nothing may land in the blocks the engine took back. The bytes stay
            # in the pipe while its write end is open, whether the prefetch (which opens and closes the FIFO before
            # the read opens it) or the read has it open; a write while neither has fails, and is tried again.
            retried(lambda: os.write(fifo, data))
        reader.start_load("after", [LoadItem(0, 1, b"b" * 32)])
        assert wait_loaded(reader) == [("after", True)]
    finally:
        os.close(fifo)   # only now: closed before the read opened the FIFO, the bytes would go and the read would wait
    assert (pages[0] == 7).all() and (pages[2] == 7).all() and (pages[3] == 7).all()
    assert not (pages[1] == 7).all()
    assert reader.has(0, b"b" * 32)   # the loader is back: hits again
    reader.close()


def test_closing_a_tier_whose_reader_hangs_ends_it(tmp_path):
    _, _, tier = make(tmp_path)
    tier.offer([(0, b"a" * 32, 1)])
    assert tier.wait_written(30)
    pid = tier.reader_pid
    os.kill(pid, signal.SIGSTOP)
    tier.start_load("stuck", [LoadItem(0, 0, b"a" * 32)])
    tier.close()
    with pytest.raises(ProcessLookupError):   # killed and reaped
        os.kill(pid, 0)


def test_a_load_larger_than_the_read_buffer_goes_in_batches_and_a_bad_file_fails_it_in_order(tmp_path):
    store = OffloadStore(tmp_path, b"m" * 32, (GroupLayout(b"g" * 16, PAGE),), 1 << 20)
    pages = torch.arange(8 * PAGE).remainder(101).to(torch.int8).view(8, PAGE)
    original = pages.clone()
    writer = OffloadTier(store, [pages], rescan_s=3600)
    writer.offer([(0, bytes([i]) * 32, i) for i in range(8)])
    writer.close()

    store = OffloadStore(tmp_path, b"m" * 32, (GroupLayout(b"g" * 16, PAGE),), 1 << 20)
    pages = torch.zeros(8, PAGE, dtype=torch.int8)
    reader = OffloadTier(store, [pages], read_bytes=4 * PAGE, rescan_s=3600)   # two pages a batch, two batches out
    reader.start_load("r", [LoadItem(0, 7 - i, bytes([i]) * 32) for i in range(8)])
    assert wait_loaded(reader) == [("r", True)] and reader.counters.loaded_blocks == 8
    assert torch.equal(pages, original.flip(0))

    bad = store.path(0, bytes([3]) * 32)
    bad.write_bytes(bad.read_bytes()[:-1] + b"x")   # corrupted: a miss, and the file goes
    reader.start_load("r2", [LoadItem(0, i, bytes([i]) * 32) for i in range(8)])   # fails with the next batch out
    assert wait_loaded(reader) == [("r2", False)] and reader.counters.load_misses == 1
    assert not bad.exists() and not reader.has(0, bytes([3]) * 32) and reader.has(0, bytes([4]) * 32)
    pages.zero_()
    reader.start_load("r3", [LoadItem(0, i, bytes([i]) * 32) for i in (7, 6, 5, 4)])   # the answers still in order
    assert wait_loaded(reader) == [("r3", True)]
    assert torch.equal(pages[4:], original[4:]) and not pages[:4].any()
    reader.close()


def test_an_offer_whose_copy_fails_gives_its_ring_range_back(tmp_path):
    _, _, tier = make(tmp_path, queue_pages=2)
    with pytest.raises(IndexError):
        tier.offer([(0, b"a" * 32, 1), (0, b"b" * 32, 99)])   # no block 99: a bug of the caller's
    assert tier.wait_written(30)
    tier.offer([(0, b"c" * 32, 1), (0, b"d" * 32, 2)])        # the whole ring again
    tier.close()
    assert tier.counters.written == 2 and tier.counters.dropped_write_error == 2
    assert tier.counters.dropped_queue_full == 0
