"""The storage tier of one engine: which blocks the offload directory holds, the write-behind of newly cached blocks,
and the loads of storage hits. Nothing here runs on the engine's step: the step asks `has` (a set lookup), offers
pages (`offer`: a copy into the staging ring, or a counted drop) and collects finished loads (`take_finished`).

The write-behind: `offer` copies the pages into a staging ring of shared memory (ring.py) on the engine's thread; a
thread sends each batch to the writer process (writer_process.py: the files are created, written and renamed there,
one per block hash with the pages of every group offered for it, so the engine's GIL is not handed back and forth
around their system calls) and records its answer in the store. Likewise the loads: a thread sends a request's files
to the reader process (reader_process.py: read and checked there, into a buffer both processes map) and copies each
group's pages from the buffer into the blocks the request was given, one call a group. Besides, a scanner asks the
store every `rescan_s` what changed (the other nodes' journals; now and then a listing of the whole directory:
store.py), so blocks other nodes wrote become hits here too.

A directory that hangs (an NFS server gone) must not hang the requests that read from it: the engine gives up on a
load older than its timeout (`abandon_overdue`). From then on the loader copies nothing more into that request's
blocks (each copy checks, under the lock the abandonment takes, that its load still stands), so the engine may
hand them to anyone; and the tier offers no hits (`has` is False) until the loader comes back from the read it is
stuck in (its reader process's), so that no other request queues behind it.
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from hybridpd.engine.histogram import HistogramCounts, HistogramSnapshot
from hybridpd.engine.kv_offload.file_reader import ReadOutcome
from hybridpd.engine.kv_offload.helper_process import HelperGone, HelperSetup
from hybridpd.engine.kv_offload.layout import mask, members
from hybridpd.engine.kv_offload.reader_process import FileToRead, ReadBatch, ReaderProcess
from hybridpd.engine.kv_offload.ring import ByteRing
from hybridpd.engine.kv_offload.store import OffloadStore
from hybridpd.engine.kv_offload.writer_process import WriteBatch, WriterProcess
from hybridpd.named_thread import NamedThread

log = logging.getLogger(__name__)

QUEUE_BYTES = 64 << 20   # the staging ring: page bytes waiting to be written at most; more are dropped (and counted)
RESCAN_S = 5.0      # how often the store is asked what other nodes wrote (or removed)
READ_BYTES = 16 << 20   # the reads' buffer: two batches of reads, each of half of it (at least one whole file)


@dataclass(frozen=True)
class LoadItem:
    group: int
    block_id: int
    block_hash: bytes


@dataclass(frozen=True)
class _Batch:
    request: ReadBatch
    rows: dict[int, tuple[int, list[int]]]   # per group: where its pages start in the buffer, the blocks they go to


@dataclass
class _Load:
    request_id: str
    items: tuple[LoadItem, ...]
    started: float            # time.monotonic() when the engine asked for it
    abandoned: bool = False   # the engine gave up on it: copy nothing more into its blocks


LOAD_SECONDS_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)


@dataclass
class TierCounters:
    written: int = 0
    dropped_queue_full: int = 0
    dropped_write_error: int = 0
    loaded_blocks: int = 0
    load_misses: int = 0       # a load that found a block missing or bad: its request is recomputed
    load_timeouts: int = 0     # a load the engine gave up on (the directory hung): its request is recomputed
    hits: int = 0              # requests that took a storage hit
    hit_tokens: int = 0        # tokens those hits covered beyond the memory hit
    # CPU seconds each of the tier's threads has used (the engine thread's share, its offers and hit searches, is not
    # in them); the writer's and the loader's: their processes' and the threads that talk to them
    writer_cpu_s: float = 0.0
    loader_cpu_s: float = 0.0
    scanner_cpu_s: float = 0.0
    # seconds from a request's read being asked for to its end (behind the reads before it included); set in
    # `snapshot`, from the loader's running counts
    load_seconds: HistogramSnapshot = HistogramSnapshot.empty(LOAD_SECONDS_BUCKETS)


class OffloadTier:
    def __init__(self, store: OffloadStore, pages: Sequence[torch.Tensor], *, queue_bytes: int = QUEUE_BYTES,
                 read_bytes: int = READ_BYTES, rescan_s: float = RESCAN_S) -> None:
        """`pages`: each group's block tensor ([num_blocks, page_bytes] int8), loads are copied into."""
        self.store = store
        self.pages = tuple(pages)
        self._page_arrays = tuple(p.numpy() for p in self.pages)   # the same memory: a numpy row copy is cheaper
        self.counters = TierCounters()
        store.scan()   # the first lists the whole directory: every block on it is a change to report
        self._writes: queue.Queue = queue.Queue()
        self._ring_fd, self._ring_map = _shared_buffer("hybridpd-kv-offload-ring", queue_bytes)
        self._staging = np.frombuffer(self._ring_map, dtype=np.int8)
        self._writer = WriterProcess(HelperSetup(str(store.folder), store.model_key, store.groups, queue_bytes),
                                     self._ring_fd)
        self._page_bytes = tuple(p.shape[1] for p in self.pages)
        self._read_bytes = max(read_bytes, 2 * sum(self._page_bytes))   # a file of every group fits a half
        self._read_fd, self._read_map = _shared_buffer("hybridpd-kv-offload-reads", self._read_bytes)
        self._read_array = np.frombuffer(self._read_map, dtype=np.int8)
        self._reader = ReaderProcess(HelperSetup(str(store.folder), store.model_key, store.groups, self._read_bytes),
                                     self._read_fd)
        try:
            self._reader.start()   # now: the first hit does not wait for a process to start
        except HelperGone as exc:
            log.warning("%s; the first load tries again", exc)
        # The ring's ranges, one per queued batch: the engine thread takes, the writer thread gives back, both under
        # the lock.
        self._ring = ByteRing(queue_bytes)
        self._queued_lock = threading.Condition()   # notified as the writer gives bytes back
        self._loads: queue.Queue = queue.Queue()
        self._load_seconds = HistogramCounts(LOAD_SECONDS_BUCKETS)
        self._load_seconds_lock = threading.Lock()
        self._finished: deque[tuple[str, bool]] = deque()
        self._pending_lock = threading.Condition()   # also guards `_inflight`, `_stalled` and every copy into pages
        self._inflight: dict[str, _Load] = {}          # loads asked for and not finished nor abandoned
        self._stalled = False                          # a load was abandoned and the loader is not back yet
        self._stop = threading.Event()
        self._rescan_s = rescan_s
        self._threads = [NamedThread(target=fn, name=f"kv-offload-{name}", daemon=True)
                         for name, fn in (("writer", self._write_loop), ("loader", self._load_loop),
                                          ("scanner", self._scan_loop))]
        for thread in self._threads:
            thread.start()

    # -- the engine's side (cheap, never waits for the disk) -----------------------------------------------------
    def has(self, group: int, block_hash: bytes) -> bool:
        return not self._stalled and self.store.holds(group, block_hash)

    @property
    def empty(self) -> bool:
        return self.store.empty

    @property
    def writer_pid(self) -> int | None:
        """The writer process's, while one runs."""
        return self._writer.pid

    @property
    def reader_pid(self) -> int | None:
        """The reader process's, while one runs."""
        return self._reader.pid

    def offer(self, blocks: Sequence[tuple[int, bytes, int]]) -> None:
        """Write blocks (group, hash, block id) behind: one copy of their pages into the staging ring, as many as it
        has room for (the rest dropped and counted); pages storage holds already are skipped. The pages of one hash
        go to one file."""
        todo, offered = [], set()
        for group, block_hash, block_id in blocks:   # a group's page of a hash once (a file holds it once)
            if (group, block_hash) not in offered and not self.store.holds(group, block_hash):
                offered.add((group, block_hash))
                todo.append((group, block_hash, block_id))
        with self._queued_lock:
            room = self._ring.room()   # only grows until the take below: the writer gives back, nothing else takes
        taken, size = 0, 0
        for group, _, _ in todo:
            if size + self.pages[group].shape[1] > room:
                break
            size += self.pages[group].shape[1]
            taken += 1
        self.counters.dropped_queue_full += len(todo) - taken
        todo = todo[:taken]
        if not todo:
            return
        ids: dict[int, list[int]] = {}                        # per group: the block ids to copy, in offer order
        by_hash: dict[bytes, list[tuple[int, int]]] = {}       # per hash: (group, its row in that group's copy)
        for group, block_hash, block_id in todo:
            group_ids = ids.setdefault(group, [])
            by_hash.setdefault(block_hash, []).append((group, len(group_ids)))
            group_ids.append(block_id)
        with self._queued_lock:
            start = self._ring.take(size)
        assert start is not None, "the ring's room shrank between room() and take()"
        offsets: dict[int, int] = {}   # per group: where its pages begin in the ring
        at = start
        try:
            for group, group_ids in ids.items():   # numpy's take: a few µs a call, torch's ops ~10 µs each
                rows, page_bytes = self._page_arrays[group].shape
                if not 0 <= min(group_ids) <= max(group_ids) < rows:
                    raise IndexError(f"block ids {group_ids} outside group {group}'s {rows} blocks")
                offsets[group] = at
                # mode="clip" writes straight into the ring ("raise" copies through a buffer); the ids are checked above
                np.take(self._page_arrays[group], group_ids, axis=0, mode="clip",
                        out=self._staging[at: at + len(group_ids) * page_bytes].reshape(-1, page_bytes))
                at += len(group_ids) * page_bytes
        except BaseException:
            self._writes.put(())   # nothing to write: the range goes back in its turn
            self.counters.dropped_write_error += len(todo)
            raise
        blocks_at = tuple((block_hash, tuple((g, offsets[g] + row * self.pages[g].shape[1]) for g, row in pages))
                          for block_hash, pages in by_hash.items())
        self._writes.put(blocks_at)

    def start_load(self, request_id: str, items: Sequence[LoadItem], num_tokens: int = 0) -> None:
        """Read `items` into their blocks (a hit of `num_tokens` beyond the memory hit); `take_finished` says when."""
        self.counters.hits += 1
        self.counters.hit_tokens += num_tokens
        load = _Load(request_id, tuple(items), time.monotonic())
        with self._pending_lock:
            self._inflight[request_id] = load
        self._loads.put(load)

    def abandon_overdue(self, timeout: float) -> list[str]:
        """Give up on the loads asked for more than `timeout` seconds ago: their requests' blocks are the engine's
        again at once (nothing more is copied into them), and no hit is offered until the loader is back."""
        now = time.monotonic()
        with self._pending_lock:
            overdue = [load for load in self._inflight.values() if now - load.started > timeout]
            for load in overdue:
                load.abandoned = True
                del self._inflight[load.request_id]
            if overdue:
                self._stalled = True
                self.counters.load_timeouts += len(overdue)
        return [load.request_id for load in overdue]

    def snapshot(self) -> TierCounters:
        with self._load_seconds_lock:   # never the pending lock: the loader holds it while it copies pages
            return replace(self.counters, load_seconds=self._load_seconds.snapshot())

    def take_changes(self) -> list[tuple[bool, int, bytes]]:
        """What the tier came to hold or lost since the last call: (held, group, hash), oldest first."""
        return self.store.take_changes()

    def take_finished(self) -> list[tuple[str, bool]]:
        done = []
        while self._finished:
            done.append(self._finished.popleft())
        return done

    @property
    def loading(self) -> bool:
        """A load is under way or finished and not yet taken."""
        return bool(self._inflight) or bool(self._finished)

    def wait_for_load(self, timeout: float) -> None:
        """Wait up to `timeout` for a load to finish (the engine does when it has nothing else to do)."""
        with self._pending_lock:
            if not self._finished:
                self._pending_lock.wait(timeout)

    def wait_written(self, timeout: float) -> bool:
        """Wait up to `timeout` until every write queued so far has reached the disk (or failed); True if so."""
        deadline = time.monotonic() + timeout
        with self._queued_lock:
            while self._ring.taken:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._queued_lock.wait(left)
        return True

    def close(self, flush_s: float = 5.0) -> None:
        """Stop the threads and the helper processes; queued writes get up to `flush_s` to reach the disk."""
        self._writes.put(None)
        self._threads[0].join(flush_s)
        self._stop.set()
        self._loads.put(None)
        loader = self._threads[1]
        loader.join(1.0)
        if loader.is_alive():   # waiting on a read of a directory that hangs
            self._reader.kill()
            loader.join(1.0)
        self._threads[2].join(1.0)
        if not loader.is_alive():
            self._reader.close(1.0)
            os.close(self._read_fd)
        if not self._threads[0].is_alive():   # else its writes may still journal
            self._writer.close(1.0)
            self.store.close()
            os.close(self._ring_fd)

    # -- threads --------------------------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            queued = self._writes.get()
            if queued is None:
                return
            # pages a file came to hold since the offer (another node's, found by a scan) are not written again
            blocks = tuple((block_hash, pages) for block_hash, pages in
                           ((block_hash, self.store.unheld(block_hash, pages)) for block_hash, pages in queued) if pages)
            try:
                results = self._writer.write(WriteBatch(blocks, self.store.mask_order)).results if blocks else ()
            except Exception as exc:  # noqa: BLE001 - nothing may stop the thread: its ring range would stay taken
                log.warning("kv offload: a batch of writes failed (%s)", exc)
                results = (str(exc),) * len(blocks)
            try:
                for (block_hash, pages), result in zip(blocks, results):
                    if isinstance(result, str):
                        self.counters.dropped_write_error += len(pages)
                        log.warning("kv offload: write dropped (%s)", result)
                    else:
                        self.store.record_write(block_hash, result)
                        self.counters.written += result.written.bit_count()
                self.store.finish_writes()
            except Exception:  # noqa: BLE001
                log.exception("kv offload: recording a batch of writes failed")
            self.counters.writer_cpu_s = self._writer.cpu_s + time.thread_time()
            with self._queued_lock:
                self._ring.give_back()
                self._queued_lock.notify_all()

    def _load_loop(self) -> None:
        while True:
            load = self._loads.get()
            if load is None:
                return
            try:
                ok = self._load(load)
            except HelperGone as exc:   # the next load starts another reader
                if not self._stop.is_set():
                    log.warning("kv offload: load of %s failed (%s)", load.request_id, exc)
                ok = False
            except Exception:  # noqa: BLE001 - any failure is a miss: the request is recomputed, never served wrong
                log.exception("kv offload: load of %s failed", load.request_id)
                ok = False
            self.counters.loader_cpu_s = self._reader.cpu_s + time.thread_time()
            with self._pending_lock:
                self._stalled = False   # back from whatever it waited for
                if not load.abandoned:   # finished before it leaves `_inflight`: `loading` (read unlocked) sees one
                    self._finished.append((load.request_id, ok))
                    del self._inflight[load.request_id]
                    with self._load_seconds_lock:
                        self._load_seconds.observe(time.monotonic() - load.started)
                self._pending_lock.notify_all()

    def _load(self, load: _Load) -> bool:
        """Read a load's pages through the reader process, half the buffer's worth of files at a time: while the
        process reads one half, the pages it read into the other are copied into the load's blocks (one call a
        group), unless the load was abandoned meanwhile. False if a page is in no file this store knows of, or its
        file is missing or bad (the store learns which)."""
        plan = self._plan(load)
        if plan is None:   # a page no file holds as far as the store knows (a scan took it away)
            self.counters.load_misses += 1
            return False
        sent: deque[_Batch] = deque()
        ok = True
        try:
            for k, files in enumerate(plan):
                if load.abandoned:
                    ok = False
                    break
                batch = self._lay_out(files, (k % 2) * (self._read_bytes // 2))
                self._reader.send(batch.request)
                sent.append(batch)
                if len(sent) == 2 and not self._finish(load, sent.popleft()):
                    ok = False
                    break
            while ok and sent:
                ok = self._finish(load, sent.popleft())
        finally:
            while sent:   # answers still owed: taken, so that the next load's come in order
                self._finish(load, sent.popleft(), copy=False)
        return ok

    def _plan(self, load: _Load) -> list[list[tuple[FileToRead, list[tuple[int, int]]]]] | None:
        """The load's files, each with the pages wanted from it ((group, block id)), in batches of at most half the
        buffer; None if a page is in no file the store knows of."""
        by_hash: dict[bytes, list[LoadItem]] = {}
        for item in load.items:
            by_hash.setdefault(item.block_hash, []).append(item)
        batches: list[list[tuple[FileToRead, list[tuple[int, int]]]]] = [[]]
        size, budget = 0, self._read_bytes // 2   # `size`: the bytes of the last batch's pages
        for block_hash, items in by_hash.items():
            want = mask(item.group for item in items)
            if want.bit_count() != len(items):
                raise ValueError(f"a load asks for a page of block {block_hash.hex()} twice")
            for file_groups in self.store.covering(block_hash, want):
                taken = [(item.group, item.block_id) for item in items if (want & file_groups) >> item.group & 1]
                want &= ~file_groups
                file_bytes = sum(self._page_bytes[group] for group, _ in taken)
                if batches[-1] and size + file_bytes > budget:
                    batches.append([])
                    size = 0
                size += file_bytes
                batches[-1].append((FileToRead(block_hash, file_groups, ()), taken))
            if want:
                return None
        return batches

    def _lay_out(self, files: list[tuple[FileToRead, list[tuple[int, int]]]], start: int) -> _Batch:
        """A batch's pages in the buffer from `start`, a group at a time (each group's rows contiguous)."""
        counts: dict[int, int] = {}
        for _, pages in files:
            for group, _ in pages:
                counts[group] = counts.get(group, 0) + 1
        base, at = {}, start
        for group, count in sorted(counts.items()):
            base[group] = at
            at += count * self._page_bytes[group]
        ids: dict[int, list[int]] = {group: [] for group in counts}
        request = []
        for file, pages in files:
            offsets = dict.fromkeys(members(file.groups))
            for group, block_id in pages:
                offsets[group] = base[group] + len(ids[group]) * self._page_bytes[group]
                ids[group].append(block_id)
            request.append(replace(file, offsets=tuple(offsets.values())))
        return _Batch(ReadBatch(tuple(request)), {group: (base[group], block_ids) for group, block_ids in ids.items()})

    def _finish(self, load: _Load, batch: _Batch, copy: bool = True) -> bool:
        """The reader's answer to `batch`: a file it could not use is the store's to forget (False); else its pages
        are copied into their blocks (`copy`), unless the load was abandoned meanwhile."""
        outcomes = self._reader.receive().outcomes
        for file, outcome in zip(batch.request.files, outcomes):
            if outcome is not ReadOutcome.READ:
                self.store.read_failed(file.block_hash, file.groups, outcome)
                self.counters.load_misses += 1
                return False
        if len(outcomes) != len(batch.request.files):
            raise RuntimeError(f"the reader answered {len(outcomes)} of {len(batch.request.files)} files")
        if not copy:
            return False
        with self._pending_lock:
            if load.abandoned:   # its blocks may be another request's by now
                return False
            for group, (start, block_ids) in batch.rows.items():
                rows, page_bytes = len(block_ids), self._page_bytes[group]
                self._page_arrays[group][block_ids] = self._read_array[start: start + rows * page_bytes
                                                                       ].reshape(rows, page_bytes)
        self.counters.loaded_blocks += sum(len(block_ids) for _, block_ids in batch.rows.values())
        return True

    def _scan_loop(self) -> None:
        while not self._stop.wait(self._rescan_s):
            try:
                self.store.scan(paced=True)   # what other nodes wrote or removed becomes the store's changes
            except OSError as exc:
                log.warning("kv offload: scan failed (%s)", exc)
            finally:
                self.counters.scanner_cpu_s = time.thread_time()


def _shared_buffer(name: str, size: int) -> tuple[int, mmap.mmap]:
    """A memfd of `size` bytes (a helper process maps it too) and this process's map of it, its memory taken now:
    the first pass through a buffer would otherwise fault its pages in one at a time, on the step (the staging ring)
    or on a request's read (~17 ms for 16 MiB here)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        return fd, mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    except BaseException:
        os.close(fd)
        raise
