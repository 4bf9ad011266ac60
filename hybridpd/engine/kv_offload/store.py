"""The offload directory: one file per (model, group, block hash), written atomically, read back checked, kept
under a capacity by evicting the least recently used files.

Layout: `ROOT/<model key>/<group key>/<hash[:2]>/<hash>.kv` (hex). A write goes to a temporary file in the same
folder and is renamed into place, so a reader sees a whole file or none, and a writer killed mid-write leaves only a
temporary file (removed by the next full listing that finds it older than a minute). A read that finds a file it
cannot use (block_file.decode says no) removes it and reports a miss. Reading a file refreshes its modification
time: the eviction order is least recently written or read.

Several nodes may share one directory (NFS, a ReadWriteMany volume): names are content addresses, so two writers
of one block write equal bytes and the last rename wins. Each store journals what it writes and removes
(journal.py, `ROOT/<model key>/journal/`), and a scan reads what the others journaled since the last one: what
changed, not every file. At least every `FULL_SCAN_S` (less often when a listing would take more than
`FULL_SCAN_CPU_SHARE` of a core) a scan lists the whole directory instead, which finds what no journal told (files
copied in or removed by hand, a writer that died between its rename and its journal line). Each store enforces the
capacity over what it knows (its last listing, the journals since, its own writes), so the directory can exceed it
by what the others wrote since this store's last scan.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hybridpd.engine.kv_offload import block_file
from hybridpd.engine.kv_offload.journal import Change, JournalReader, JournalWriter

log = logging.getLogger(__name__)

STALE_TEMP_S = 60.0
FULL_SCAN_S = 60.0            # a scan lists the whole directory at least this often ...
FULL_SCAN_CPU_SHARE = 0.02    # ... unless listings would take more of a core than this: then as often as they fit


@dataclass(frozen=True)
class GroupLayout:
    key: bytes         # identity.group_key
    page_bytes: int    # the payload of one block


class OffloadStore:
    def __init__(self, root: Path, model_key: bytes, groups: tuple[GroupLayout, ...], capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"--kv-offload-size must be positive, got {capacity_bytes}")
        self.model_key = model_key
        self.groups = groups
        self.capacity = capacity_bytes
        self.model_dir = Path(root) / model_key.hex()
        self._group_dirs = tuple(self.model_dir / g.key.hex() for g in groups)
        for d in self._group_dirs:
            d.mkdir(parents=True, exist_ok=True)
        self._dir_names = tuple(str(d) for d in self._group_dirs)   # plain strings: the hot paths join them
        self._shards: set[str] = set()                              # shard folders known to exist
        self._lock = threading.Lock()   # guards `_disk`, `_used`, `_listing_changes` and `_unjournaled`
        # Each group's block hashes on disk as far as this store knows: its last listing, the others' journals since
        # and its own changes.
        self._disk: tuple[set[bytes], ...] = tuple(set() for _ in groups)
        self._used = 0   # the bytes of the files in `_disk`
        self._listing_changes: list[tuple[bool, int, bytes]] | None = None   # own changes while a listing runs
        self._unjournaled: list[Change] = []   # own changes for the journal, appended a batch at a time
        self._keys = {g.key: index for index, g in enumerate(groups)}
        self._journal = JournalWriter(self.model_dir / "journal")
        self._others = JournalReader(self.model_dir / "journal", self._journal.names)
        self._next_full = 0.0   # time.monotonic() from which a scan lists the whole directory
        # What this store came to hold or lost, oldest first: (True: held / False: gone, group, hash), for the tier's
        # KV events (`take_changes`).
        self._feed: deque[tuple[bool, int, bytes]] = deque()

    def path(self, group: int, block_hash: bytes) -> Path:
        return Path(self._name(group, block_hash))

    def _name(self, group: int, block_hash: bytes) -> str:
        name = block_hash.hex()
        return f"{self._dir_names[group]}/{name[:2]}/{name}.kv"

    def file_bytes(self, group: int) -> int:
        return block_file.HEADER_SIZE + self.groups[group].page_bytes

    def write(self, group: int, block_hash: bytes, payload: memoryview) -> bool:
        """Write one block (False if it is there already). OSError (a full disk, a read-only volume) propagates."""
        (result,) = self.write_many(group, ((block_hash, payload),))
        if isinstance(result, OSError):
            raise result
        return result

    def write_many(self, group: int, blocks: Iterable[tuple[bytes, memoryview]]) -> list[bool | OSError]:
        """Write a group's blocks (hash, payload), one file each: per block True (written), False (there already) or
        the OSError that kept it out; then one journal append and one capacity check for them all."""
        results: list[bool | OSError] = []
        for block_hash, payload in blocks:
            try:
                results.append(self._write_file(group, block_hash, payload))
            except OSError as exc:
                results.append(exc)
        self._evict_over_capacity()
        self._flush_journal()
        return results

    def _write_file(self, group: int, block_hash: bytes, payload: memoryview) -> bool:
        path = self._name(group, block_hash)
        if os.path.exists(path):   # another writer's: it journaled it
            self._changed(True, group, block_hash, journal=False)
            return False
        shard = path[: path.rindex("/")]
        if shard not in self._shards:
            os.makedirs(shard, exist_ok=True)
            self._shards.add(shard)
        temp = f"{shard}/.{block_hash.hex()}.{os.getpid()}.{threading.get_ident()}.tmp"   # one per writer thread
        header = block_file.encode_header(self.model_key, self.groups[group].key, block_hash, payload)
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.writev(fd, [header, payload])
            finally:
                os.close(fd)
            os.replace(temp, path)
        except BaseException:
            try:
                os.unlink(temp)
            except OSError:
                pass
            raise
        self._changed(True, group, block_hash)
        return True

    def _changed(self, added: bool, group: int, block_hash: bytes, journal: bool = True) -> None:
        """A block file is there or gone: what this store knows, and (`journal`: it wrote or removed the file itself)
        a line for its journal, appended at `_flush_journal`."""
        with self._lock:
            hashes = self._disk[group]
            if added and block_hash not in hashes:
                hashes.add(block_hash)
                self._used += self.file_bytes(group)
                self._feed.append((True, group, block_hash))
            elif not added and block_hash in hashes:
                hashes.discard(block_hash)
                self._used -= self.file_bytes(group)
                self._feed.append((False, group, block_hash))
            if self._listing_changes is not None:
                self._listing_changes.append((added, group, block_hash))
            if journal:
                self._unjournaled.append(Change(added, self.groups[group].key, block_hash))

    def _flush_journal(self) -> None:
        with self._lock:
            changes, self._unjournaled = self._unjournaled, []
        try:
            self._journal.append(changes)
        except OSError as exc:   # the others find the changes at their next full listing
            log.warning("kv offload: journal append failed (%s)", exc)

    def holds(self, group: int, block_hash: bytes) -> bool:
        """Whether the block is on disk as far as this store knows (a set lookup: the engine's step asks it)."""
        return block_hash in self._disk[group]

    @property
    def empty(self) -> bool:
        return not any(self._disk)

    def take_changes(self) -> list[tuple[bool, int, bytes]]:
        """What this store came to hold or lost since the last call: (held, group, hash), oldest first."""
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
        """The block's payload, or None if there is no usable file (a bad one is removed)."""
        path = self._name(group, block_hash)
        data = bytearray(self.file_bytes(group) + 1)   # one byte more: a longer file is not this block either
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:   # gone (removed by hand, or by a writer whose journal is not read yet), or unreadable
            self._changed(False, group, block_hash, journal=False)   # not counted on again until seen again
            return None
        try:
            size = os.readv(fd, [data])
            os.utime(fd)   # the eviction order: least recently written or read
        except OSError:
            self._changed(False, group, block_hash, journal=False)
            return None
        finally:
            os.close(fd)
        del data[size:]
        payload = block_file.decode(data, self.model_key, self.groups[group].key, block_hash,
                                    self.groups[group].page_bytes)
        if payload is None:
            removed = self._remove(Path(path))
            self._changed(False, group, block_hash, journal=removed)
            self._flush_journal()
            return None
        return payload

    def scan(self, full: bool | None = None) -> tuple[set[bytes], ...]:
        """Learn what changed on disk: the others' journals read since the last scan, or (`full`, and by default
        every `FULL_SCAN_S`) a listing of the whole directory. Returns every group's block hashes as far as this store
        now knows (its own sets, not copies: read them, never change them). What a scan misses is only a miss or a
        failed read, never wrong bytes: reads are checked."""
        now = time.monotonic()
        changes = self._others.read_new()   # read before a listing, so the listing supersedes them
        if full or (full is None and now >= self._next_full):
            started = time.thread_time()
            self._list_all()
            cost = time.thread_time() - started
            self._next_full = time.monotonic() + max(FULL_SCAN_S, cost / FULL_SCAN_CPU_SHARE)
        else:
            for change in changes:
                if (group := self._keys.get(change.group_key)) is not None:
                    self._changed(change.added, group, change.block_hash, journal=False)
        self._evict_over_capacity()
        self._flush_journal()
        return self._disk

    def _list_all(self) -> None:
        """Every group's block files as the directory lists them now (stale temporary files and journals removed);
        the changes this store made or met during the listing are applied after it."""
        with self._lock:
            self._listing_changes = []
        now = time.time()
        disk: list[set[bytes]] = []
        for d in self._group_dirs:
            hashes: set[bytes] = set()
            for shard in _shards(d):
                for name in _names(shard.path):
                    if name.endswith(".tmp"):
                        path = f"{shard.path}/{name}"
                        if now - _mtime(path) > STALE_TEMP_S:
                            self._remove(Path(path))
                    elif (block_hash := _block_hash(name)) is not None:
                        hashes.add(block_hash)
            disk.append(hashes)
        self._others.remove_stale(now)
        with self._lock:
            for added, group, block_hash in self._listing_changes or ():
                (disk[group].add if added else disk[group].discard)(block_hash)
            self._listing_changes = None
            for group, (old, new) in enumerate(zip(self._disk, disk)):
                self._feed.extend((False, group, block_hash) for block_hash in old - new)
                self._feed.extend((True, group, block_hash) for block_hash in new - old)
            self._disk = tuple(disk)
            self._used = sum(len(hashes) * self.file_bytes(group) for group, hashes in enumerate(disk))

    def _evict_over_capacity(self) -> None:
        used = self.used_bytes()
        if used <= self.capacity:
            return
        files = sorted(((_mtime(e), group, Path(e.path), block_hash) for group, d in enumerate(self._group_dirs)
                        for e in _files(d) if (block_hash := _block_hash(e.name)) is not None),
                       key=lambda item: item[0])
        target = self.capacity * 9 // 10  # evict a tenth at a time, not a file per write
        for _, group, path, block_hash in files:
            if used <= target:
                return
            if self._remove(path):
                used -= self.file_bytes(group)   # known to this store or not: it took that much
                self._changed(False, group, block_hash)

    @staticmethod
    def _remove(path: Path) -> bool:
        try:
            path.unlink()
            return True
        except OSError:
            return False


def _shards(group_dir: Path) -> list[os.DirEntry]:
    try:
        return [entry for entry in os.scandir(group_dir) if entry.is_dir()]
    except OSError:
        return []


def _names(shard: str) -> list[str]:
    try:
        return os.listdir(shard)
    except OSError:
        return []


def _block_hash(name: str) -> bytes | None:
    """The block hash a file name stands for (None: not a block file)."""
    if not name.endswith(".kv"):
        return None
    try:
        return bytes.fromhex(name[:-3])
    except ValueError:
        return None


def _entries(shard: str) -> list[os.DirEntry]:
    try:
        return list(os.scandir(shard))
    except OSError:
        return []


def _files(group_dir: Path) -> Iterator[os.DirEntry]:
    for shard in _shards(group_dir):
        yield from _entries(shard.path)


def _mtime(path: str | os.DirEntry) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0
