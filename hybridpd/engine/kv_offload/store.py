"""The offload directory: one file per (model, group, block hash), written atomically, read back checked, kept
under a capacity by evicting the least recently used files.

Layout: `ROOT/<model key>/<group key>/<hash[:2]>/<hash>.kv` (hex). A write goes to a temporary file in the same
folder and is renamed into place, so a reader sees a whole file or none, and a writer killed mid-write leaves only a
temporary file (removed by the next scan that finds it older than a minute). A read that finds a file it cannot use
(block_file.decode says no) removes it and reports a miss. Reading a file refreshes its modification time: the
eviction order is least recently written or read.

Several nodes may share one directory (NFS, a ReadWriteMany volume): names are content addresses, so two writers
of one block write equal bytes and the last rename wins; each node enforces the capacity over what its last scan
saw plus what it wrote since, so the directory can exceed it by what the others wrote since that scan.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hybridpd.engine.kv_offload import block_file

STALE_TEMP_S = 60.0
SETTLE_S = 2.0           # a shard folder changed this recently is listed again at the next scan
FULL_SCAN_EVERY = 12     # every 12th scan lists every folder (1 min at the tier's 5 s)


@dataclass(frozen=True)
class _Listing:
    """One shard folder as a scan listed it."""

    mtime_ns: int
    names: frozenset[str]       # every entry, as listed
    hashes: frozenset[bytes]    # the block files among them
    temporary: frozenset[str]   # the temporary files among them (they age without touching the folder's time)
    settled: bool = False       # its time was older than SETTLE_S at the listing


_EMPTY = _Listing(-1, frozenset(), frozenset(), frozenset())


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
        self._lock = threading.Lock()
        self._used = 0   # bytes under the model's folder: the last scan's sum, plus writes, minus evictions
        self._listings: dict[str, _Listing] = {}   # shard folder -> its last listing (scan lists only what moved)
        self._scans = 0
        self.on_removed: Callable[[int, bytes], None] = lambda group, block_hash: None

    def path(self, group: int, block_hash: bytes) -> Path:
        return Path(self._name(group, block_hash))

    def _name(self, group: int, block_hash: bytes) -> str:
        name = block_hash.hex()
        return f"{self._dir_names[group]}/{name[:2]}/{name}.kv"

    def file_bytes(self, group: int) -> int:
        return block_file.HEADER_SIZE + self.groups[group].page_bytes

    def write(self, group: int, block_hash: bytes, payload: memoryview) -> bool:
        """Write one block (False if it is there already). OSError (a full disk, a read-only volume) propagates."""
        path = self._name(group, block_hash)
        if os.path.exists(path):
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
        with self._lock:
            self._used += self.file_bytes(group)
        self._evict_over_capacity()
        return True

    def read(self, group: int, block_hash: bytes) -> memoryview | None:
        """The block's payload, or None if there is no usable file (a bad one is removed)."""
        path = self._name(group, block_hash)
        data = bytearray(self.file_bytes(group) + 1)   # one byte more: a longer file is not this block either
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            size = os.readv(fd, [data])
            os.utime(fd)   # the eviction order: least recently written or read
        except OSError:
            return None
        finally:
            os.close(fd)
        del data[size:]
        payload = block_file.decode(data, self.model_key, self.groups[group].key, block_hash,
                                    self.groups[group].page_bytes)
        if payload is None:
            if self._remove(Path(path)):
                self.on_removed(group, block_hash)
            return None
        return payload

    def scan(self) -> tuple[set[bytes], ...]:
        """Every group's block hashes on disk now (and the bytes they use, for the capacity).

        Only shard folders whose modification time moved since they were last listed are listed again (a file
        added, renamed in or removed changes its folder's time), with three guards: a folder whose time is within
        `SETTLE_S` of its listing is listed again next time (two changes inside the clock's tick look like one), a
        folder holding temporary files is listed until they are gone (they age without touching it), and every
        `FULL_SCAN_EVERY`-th scan lists everything (clocks of other hosts on a shared volume may be off). What a scan
        misses is only a miss or a failed read, never wrong bytes: reads are checked."""
        self._scans += 1
        full = self._scans % FULL_SCAN_EVERY == 1
        present: list[set[bytes]] = []
        used = 0
        now = time.time()
        for group, d in enumerate(self._group_dirs):
            hashes: set[bytes] = set()
            for shard in _shards(d):
                listing = self._listing(shard, now, full)
                hashes |= listing.hashes
            present.append(hashes)
            used += len(hashes) * self.file_bytes(group)
        with self._lock:
            self._used = used
        self._evict_over_capacity()
        return tuple(present)

    def _listing(self, shard: os.DirEntry, now: float, full: bool) -> _Listing:
        """What `shard` holds: its last listing if its time has not moved, else a new one. A new listing parses only
        the names that came or went since the last (a folder of a busy directory changes by a few files between
        scans, and its other names cost nothing but the listing itself)."""
        try:
            mtime_ns = shard.stat().st_mtime_ns
        except OSError:
            return _EMPTY
        known = self._listings.get(shard.path, _EMPTY)
        if not full and known.mtime_ns == mtime_ns and known.settled and not known.temporary:
            return known
        names = frozenset(_names(shard.path))
        hashes, temporary = set(known.hashes), set(known.temporary)
        for name in known.names - names:
            hashes.discard(_block_hash(name))
            temporary.discard(name)
        for name in names - known.names:
            if name.endswith(".tmp"):
                temporary.add(name)
            elif (block_hash := _block_hash(name)) is not None:
                hashes.add(block_hash)
        for name in list(temporary):
            path = f"{shard.path}/{name}"
            if now - _mtime(path) > STALE_TEMP_S and self._remove(Path(path)):
                temporary.discard(name)
        listing = _Listing(mtime_ns, names, frozenset(hashes), frozenset(temporary),
                           settled=mtime_ns < (now - SETTLE_S) * 1e9)
        self._listings[shard.path] = listing
        return listing

    def _evict_over_capacity(self) -> None:
        with self._lock:
            if self._used <= self.capacity:
                return
        files = sorted(((_mtime(e), group, Path(e.path), block_hash) for group, d in enumerate(self._group_dirs)
                        for e in _files(d) if (block_hash := _block_hash(e.name)) is not None),
                       key=lambda item: item[0])
        target = self.capacity * 9 // 10  # evict a tenth at a time, not a file per write
        for _, group, path, block_hash in files:
            with self._lock:
                if self._used <= target:
                    return
            if self._remove(path):
                with self._lock:
                    self._used -= self.file_bytes(group)
                self.on_removed(group, block_hash)

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
