"""The offload directory: one file per block hash holding the pages of the groups written behind together (usually
every group that caches a block there), written atomically, read back checked, kept under a capacity by evicting
the least recently used files.

Layout: `ROOT/<model key>/<layout key>/<hash[:2]>/<hash>.<groups>.kv` (hex; the layout key covers every group's key,
`groups` is the bit mask of the groups whose pages the file holds, in group order). A hash may have several files
(another writer, or a later offer, wrote other groups' pages of it); a group's page is read from whichever holds it.
One file for all the groups of a block position, not one per group: a file's create, write and rename cost more
than its bytes do at these page sizes. A write goes to a temporary file in the same folder and is renamed into
place, so a reader sees a whole file or none, and a writer killed mid-write leaves only a temporary file (removed by
the next full listing that finds it older than a minute). A read that finds a file it cannot use (block_file.intact
says no) removes it and reports a miss. Reading a file refreshes its modification time: the eviction order is least
recently written or read.

Several nodes may share one directory (NFS, a ReadWriteMany volume): names are content addresses, so two writers
of one block write equal bytes and the last rename wins. Each store journals what it writes and removes
(journal.py, `ROOT/<model key>/<layout key>/journal/`), and a scan reads what the others journaled since the last
one: what changed, not every file. At least every `FULL_SCAN_S` (less often when a listing would take more than
`FULL_SCAN_CPU_SHARE` of a core) a scan lists the whole directory instead, which finds what no journal told (files
copied in or removed by hand, a writer that died between its rename and its journal line): rare, and at worst a
missed hit or a failed read (a recompute) meanwhile, while a listing of the ~100,000 files of a busy directory takes
each node 0.1-0.4 s of CPU, so every five minutes, not every minute. Each store enforces the
capacity over what it knows (its last listing, the journals since, its own writes), so the directory can exceed it
by what the others wrote since this store's last scan.

The tier's scanner runs in the engine's process, and a listing is Python work over every name (~2-5 us each): run
at once, a listing of tens of thousands of files holds the GIL for a few hundred milliseconds, and every torch call
of a step beside it waits for the GIL to come back (the step 2-3x as long, some far longer). So a `paced` listing
(the scanner's) works about `LISTING_BURST_S` at a time (between shard folders, and every 256 hashes of the tally of
what they hold), then sleeps `LISTING_PAUSE_S`: it takes longer, and the steps beside it hardly notice
(benchmarks/offload_scan.py's `step_*` figures).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from hybridpd.engine.kv_offload import block_file
from hybridpd.engine.kv_offload.file_reader import ReadOutcome, read_into
from hybridpd.engine.kv_offload.file_writer import BlockFileWriter, Written
from hybridpd.engine.kv_offload.journal import Change, JournalReader, JournalWriter
from hybridpd.engine.kv_offload.layout import (
    GroupLayout,
    block_path,
    largest_first,
    layout_key,
    mask,
    members,
    parse_block_name,
    union,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

STALE_TEMP_S = 60.0
FULL_SCAN_S = 300.0           # a scan lists the whole directory at least this often ...
FULL_SCAN_CPU_SHARE = 0.005   # ... unless listings would take more of a core than this: then as often as they fit
LISTING_BURST_S = 0.001       # a paced listing works about this long at a time ...
LISTING_PAUSE_S = 0.004       # ... then sleeps this long (the module docstring)


class OffloadStore:
    def __init__(self, root: Path, model_key: bytes, groups: tuple[GroupLayout, ...], capacity_bytes: int, *,
                 feed: bool = False) -> None:
        """`feed`: keep what this store comes to hold or loses for `take_changes` (the KV events); without it nothing
        is kept, so a node that publishes no events does not pile the changes up."""
        if capacity_bytes <= 0:
            raise ValueError(f"--kv-offload-size must be positive, got {capacity_bytes}")
        self.model_key = model_key
        self.groups = groups
        self.capacity = capacity_bytes
        self.folder = Path(root) / model_key.hex() / layout_key(groups).hex()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._folder = str(self.folder)   # a plain string: the hot paths join it
        self._all_groups = (1 << len(groups)) - 1
        self._file_bytes: dict[int, int] = {}   # by the bit mask of a file's groups
        self._writer = BlockFileWriter(self._folder, model_key, groups)
        self._lock = threading.Lock()   # guards `_files`, `_held`, `_used`, `_listing_changes` and `_unjournaled`
        # The block files on disk as far as this store knows (its last listing, the others' journals since and its
        # own changes): each hash's files, by the bit mask of their groups; and per group the hashes some file holds.
        self._files: dict[bytes, set[int]] = {}
        self._held: tuple[set[bytes], ...] = tuple(set() for _ in groups)
        self._used = 0   # the bytes of the files in `_files`
        self._masks: set[int] = set()              # the sets of groups files have been seen with ...
        self._mask_order: tuple[int, ...] = ()     # ... the largest first
        self._listing_changes: list[tuple[bool, bytes, int]] | None = None   # own changes while a listing runs
        self._unjournaled: list[Change] = []   # own changes for the journal, appended a batch at a time
        self._journal = JournalWriter(self.folder / "journal")
        self._others = JournalReader(self.folder / "journal", self._journal.names)
        self._next_full = 0.0   # time.monotonic() from which a scan lists the whole directory
        # What this store came to hold or lost, oldest first: (True: held / False: gone, group, hash), for the tier's
        # KV events (`take_changes`).
        self._feed: deque[tuple[bool, int, bytes]] | None = deque() if feed else None

    def path(self, group: int, block_hash: bytes) -> Path:
        """The file that holds `group`'s page of the block as far as this store knows, else the one that would hold
        that page alone."""
        files = self.covering(block_hash, 1 << group)
        return Path(self._name(block_hash, files[0] if files else 1 << group))

    def _name(self, block_hash: bytes, groups: int) -> str:
        return block_path(self._folder, block_hash, groups)

    def _parse(self, name: str) -> tuple[bytes, int] | None:
        """(block hash, groups) of a block file's name; None for any other name."""
        return parse_block_name(name, self._all_groups)

    def file_bytes(self, groups: int) -> int:
        """The size of a block file holding the pages of `groups` (a bit mask)."""
        size = self._file_bytes.get(groups)
        if size is None:
            held = members(groups)
            size = self._file_bytes[groups] = (block_file.header_size(len(held))
                                               + sum(self.groups[g].page_bytes for g in held))
        return size

    def write(self, group: int, block_hash: bytes, payload: memoryview) -> bool:
        """Write one group's page of a block (False if it is there already). OSError (a full disk, a read-only
        volume) propagates."""
        (result,) = self.write_many(((block_hash, ((group, payload),)),))
        if isinstance(result, OSError):
            raise result
        return result > 0

    def write_many(self, blocks: Iterable[tuple[bytes, Sequence[tuple[int, memoryview]]]]) -> list[int | OSError]:
        """Write blocks (hash, its pages: (group, payload) each), one file each: per block the number of pages written
        (0: files hold them all already) or the OSError that kept it out; then one journal append and one capacity
        check for them all."""
        results: list[int | OSError] = []
        for block_hash, pages in blocks:
            try:
                results.append(self._write_file(block_hash, pages))
            except OSError as exc:
                results.append(exc)
        self.finish_writes()
        return results

    def unheld(self, block_hash: bytes, pages: Iterable[tuple[int, T]]) -> tuple[tuple[int, T], ...]:
        """The (group, ...) pages of the block whose group no file holds, as far as this store knows."""
        return tuple(page for page in pages if block_hash not in self._held[page[0]])

    def _write_file(self, block_hash: bytes, pages: Sequence[tuple[int, memoryview]]) -> int:
        pages = self.unheld(block_hash, pages)
        if not pages:   # a file holds every one of them already
            return 0
        result = self._writer.write(block_hash, pages, self._mask_order)
        self.record_write(block_hash, result)
        return result.written.bit_count()

    def record_write(self, block_hash: bytes, result: Written) -> None:
        """What a write of the block did: the files it found (another writer's) and the one it wrote."""
        for groups in result.found:
            self._changed(True, block_hash, groups, journal=False)
        if result.written:
            self._changed(True, block_hash, result.written)

    def finish_writes(self) -> None:
        """After a batch of writes: one capacity check and one journal append for them all."""
        self._evict_over_capacity()
        self._flush_journal()

    @property
    def mask_order(self) -> tuple[int, ...]:
        """The sets of groups files have been seen with, the largest first (a write looks for the block under each)."""
        return self._mask_order

    def _changed(self, added: bool, block_hash: bytes, groups: int, journal: bool = True) -> None:
        """A block file is there or gone: what this store knows, and (`journal`: it wrote or removed the file itself)
        a line for its journal, appended at `_flush_journal`."""
        with self._lock:
            changed = _file_change(self._files, added, block_hash, groups)
            if changed is not None:
                if added:
                    self._seen(groups)
                self._used += self.file_bytes(groups) if added else -self.file_bytes(groups)
                self._report(added, block_hash, changed)
            if self._listing_changes is not None:
                self._listing_changes.append((added, block_hash, groups))
            if journal:
                self._unjournaled.append(Change(added, groups, block_hash))

    def _seen(self, groups: int) -> None:
        """Files with these groups exist (under the lock)."""
        if groups not in self._masks:
            self._masks.add(groups)
            self._mask_order = largest_first(self._masks)

    def _report(self, held: bool, block_hash: bytes, groups: int) -> None:
        """The groups of `groups` came to hold the block, or lost it (under the lock)."""
        for group in members(groups):
            (self._held[group].add if held else self._held[group].discard)(block_hash)
            if self._feed is not None:
                self._feed.append((held, group, block_hash))

    def _flush_journal(self) -> None:
        with self._lock:
            changes, self._unjournaled = self._unjournaled, []
        try:
            self._journal.append(changes)
        except OSError as exc:   # the others find the changes at their next full listing
            log.warning("kv offload: journal append failed (%s)", exc)

    def holds(self, group: int, block_hash: bytes) -> bool:
        """Whether a file holds the group's page of the block as far as this store knows (a set lookup: the engine's
        step asks it)."""
        return block_hash in self._held[group]

    @property
    def empty(self) -> bool:
        return not self._files

    def take_changes(self) -> list[tuple[bool, int, bytes]]:
        """What this store came to hold or lost since the last call: (held, group, hash), oldest first (nothing
        without `feed`)."""
        changes = []
        while self._feed:
            changes.append(self._feed.popleft())
        return changes

    def used_bytes(self) -> int:
        """The bytes of the block files this store knows of."""
        return self._used

    def close(self) -> None:
        self._flush_journal()
        self._journal.close()

    def read(self, group: int, block_hash: bytes) -> memoryview | None:
        """One group's page of the block, or None if there is no usable file for it (a bad one is removed)."""
        pages = self.read_many(block_hash, (group,))
        return None if pages is None else pages[group]

    def read_many(self, block_hash: bytes, groups: Iterable[int]) -> dict[int, memoryview] | None:
        """The pages of `groups` of the block, by group, read from the files this store knows hold them (the fewest
        that cover them); None if one is missing, gone or bad (a bad file is removed)."""
        want = mask(groups)
        pages: dict[int, memoryview] = {}
        for file_groups in self.covering(block_hash, want):
            payloads = self._read_file(block_hash, file_groups)
            if payloads is None:
                return None
            pages.update((group, payload) for group, payload in zip(members(file_groups), payloads)
                         if want >> group & 1)
            want &= ~file_groups
        return None if want else pages

    def covering(self, block_hash: bytes, want: int) -> list[int]:
        """The files (by their groups) that hold the groups of `want`, the largest first, each adding some."""
        with self._lock:
            files = sorted(self._files.get(block_hash, ()), key=lambda groups: -groups.bit_count())
        chosen = []
        for file_groups in files:
            if want & file_groups:
                chosen.append(file_groups)
                want &= ~file_groups
        return chosen

    def _read_file(self, block_hash: bytes, groups: int) -> list[memoryview] | None:
        pages = [memoryview(bytearray(self.groups[group].page_bytes)) for group in members(groups)]
        outcome = read_into(self._name(block_hash, groups), self.model_key, block_hash, self.layouts(groups), pages)
        if outcome is not ReadOutcome.READ:
            self.read_failed(block_hash, groups, outcome)
            return None
        return pages

    def layouts(self, groups: int) -> list[tuple[bytes, int]]:
        """(group key, page bytes) of each group of `groups`, in order: what a file of those groups holds."""
        return [(self.groups[group].key, self.groups[group].page_bytes) for group in members(groups)]

    def read_failed(self, block_hash: bytes, groups: int, outcome: ReadOutcome) -> None:
        """A read of the block's file of `groups` found it missing (gone: removed by hand, or by a writer whose journal
        is not read yet; or unreadable) or bad (removed here): not counted on again until seen again."""
        removed = outcome is ReadOutcome.BAD and self._remove(Path(self._name(block_hash, groups)))
        self._changed(False, block_hash, groups, journal=removed)
        if removed:
            self._flush_journal()

    def scan(self, full: bool | None = None, *, paced: bool = False) -> tuple[set[bytes], ...]:
        """Learn what changed on disk: the others' journals read since the last scan, or (`full`, and by default
        every `FULL_SCAN_S`) a listing of the whole directory, `paced` or at once (the module docstring). Returns every
        group's block hashes as far as this store now knows (its own sets, not copies: read them, never change them).
        What a scan misses is only a miss or a failed read, never wrong bytes: reads are checked."""
        now = time.monotonic()
        changes = self._others.read_new()   # read before a listing, so the listing supersedes them
        if full or (full is None and now >= self._next_full):
            started = time.thread_time()   # CPU time: a paced listing's pauses are not its cost
            self._list_all(paced)
            cost = time.thread_time() - started
            self._next_full = time.monotonic() + max(FULL_SCAN_S, cost / FULL_SCAN_CPU_SHARE)
        else:
            for change in changes:
                if change.groups <= self._all_groups:
                    self._changed(change.added, change.block_hash, change.groups, journal=False)
        self._evict_over_capacity()
        self._flush_journal()
        return self._held

    def _list_all(self, paced: bool = False) -> None:
        """Every block file as the directory lists them now (stale temporary files and journals removed); the
        changes this store made or met during the listing are applied after it. `paced`: the walk over the folders
        and the tally of what they hold pause after each `LISTING_BURST_S` of work (the module docstring); only the
        changes met meanwhile are applied under the lock."""
        with self._lock:
            self._listing_changes = []
        now = time.time()
        files: dict[bytes, set[int]] = {}
        pace = _Pace(paced)
        for shard in _shards(self.folder):
            for name in _names(shard.path):
                if name.endswith(".tmp"):
                    path = f"{shard.path}/{name}"
                    if now - _mtime(path) > STALE_TEMP_S:
                        self._remove(Path(path))
                elif (parsed := self._parse(name)) is not None:
                    files.setdefault(parsed[0], set()).add(parsed[1])
            pace.tick()
        self._others.remove_stale(now)
        held: tuple[set[bytes], ...] = tuple(set() for _ in self.groups)
        used, seen = 0, set()
        for i, (block_hash, masks) in enumerate(files.items()):
            for group in members(union(masks)):
                held[group].add(block_hash)
            for groups in masks:
                used += self.file_bytes(groups)
                seen.add(groups)
            if i % 256 == 255:
                pace.tick()
        with self._lock:
            for added, block_hash, groups in self._listing_changes or ():
                changed = _file_change(files, added, block_hash, groups)
                if changed is not None:
                    if added:
                        seen.add(groups)
                    used += self.file_bytes(groups) if added else -self.file_bytes(groups)
                    for group in members(changed):
                        (held[group].add if added else held[group].discard)(block_hash)
            self._listing_changes = None
            for groups in seen:
                self._seen(groups)
            for group, (old, new) in enumerate(zip(self._held, held)):
                if self._feed is not None:
                    self._feed.extend((False, group, block_hash) for block_hash in old - new)
                    self._feed.extend((True, group, block_hash) for block_hash in new - old)
            self._files, self._held, self._used = files, held, used

    def _evict_over_capacity(self) -> None:
        used = self.used_bytes()
        if used <= self.capacity:
            return
        files = sorted(((_mtime(e), e.path, parsed) for e in _files(self.folder)
                        if (parsed := self._parse(e.name)) is not None), key=lambda item: item[0])
        target = self.capacity * 9 // 10  # evict a tenth at a time, not a file per write
        for _, path, (block_hash, groups) in files:
            if used <= target:
                return
            if self._remove(Path(path)):
                used -= self.file_bytes(groups)   # known to this store or not: it took that much
                self._changed(False, block_hash, groups)

    @staticmethod
    def _remove(path: Path) -> bool:
        try:
            path.unlink()
            return True
        except OSError:
            return False


def _file_change(files: dict[bytes, set[int]], added: bool, block_hash: bytes, groups: int) -> int | None:
    """A block file of `groups` is there (`added`) or gone, applied to `files` (each hash's files by their groups):
    the groups the hash came to hold or no longer holds in any file; None if `files` already said so."""
    masks = files.get(block_hash)
    if added and (masks is None or groups not in masks):
        masks = files.setdefault(block_hash, set())
        before = union(masks)
        masks.add(groups)
        return groups & ~before
    if not added and masks is not None and groups in masks:
        masks.discard(groups)
        if not masks:
            del files[block_hash]
        return groups & ~union(masks)
    return None


class _Pace:
    """A paced listing's clock: `tick` between pieces of work sleeps `LISTING_PAUSE_S` once `LISTING_BURST_S` of
    work has passed since the last pause; unpaced, it never sleeps."""

    def __init__(self, paced: bool) -> None:
        self._paced = paced
        self._since = time.perf_counter()

    def tick(self) -> None:
        if self._paced and time.perf_counter() - self._since >= LISTING_BURST_S:
            time.sleep(LISTING_PAUSE_S)
            self._since = time.perf_counter()


def _shards(folder: Path) -> list[os.DirEntry]:
    """The shard folders (two hex digits each; not the journals')."""
    try:
        return [entry for entry in os.scandir(folder) if len(entry.name) == 2 and entry.is_dir()]
    except OSError:
        return []


def _names(shard: str) -> list[str]:
    try:
        return os.listdir(shard)
    except OSError:
        return []


def _entries(shard: str) -> list[os.DirEntry]:
    try:
        return list(os.scandir(shard))
    except OSError:
        return []


def _files(folder: Path) -> Iterator[os.DirEntry]:
    for shard in _shards(folder):
        yield from _entries(shard.path)


def _mtime(path: str | os.DirEntry) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0
