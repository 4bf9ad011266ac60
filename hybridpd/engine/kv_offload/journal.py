"""Each writer's journal of the block files it added and removed, so that nodes sharing an offload directory learn
of each other's writes by reading what changed instead of listing every file.

Layout: `<store folder>/journal/<writer id>.<n>.log`, each appended to by one writer only (a store: one process),
one line per change: `+<groups hex> <block hash hex>` after a file was renamed into place, `-...` after one was
removed (the groups: the bit mask of the groups whose pages the file holds, as its name says). A reader keeps an
offset per journal and reads what was appended since; a line still missing its newline waits for the next read. A
writer begins a new journal after `MAX_BYTES`; a journal untouched for `KEEP_S` is removed by whichever store lists
the whole directory next: nothing in it is news to anyone (a running store reads every journal every few seconds,
and a store that starts lists the whole directory first).

The journals are hints, not the truth: every store still lists the whole directory now and then, and every read is
checked. A lost, torn, forged or foreign line costs a miss or a failed load, never wrong bytes.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MAX_BYTES = 4 << 20     # a journal's size before its writer begins the next (~40,000 lines)
KEEP_S = 600.0          # a journal untouched this long is removed at a full listing ...
IDLE_S = KEEP_S / 2     # ... so a writer idle this long begins a new one rather than append to one maybe gone
SUFFIX = ".log"
HEX_DIGITS = b"0123456789abcdef"


@dataclass(frozen=True)
class Change:
    added: bool           # True: the file was written; False: removed
    groups: int           # the file's groups, a bit per group of the store's layout
    block_hash: bytes

    def line(self) -> bytes:
        return f"{'+' if self.added else '-'}{self.groups:x} {self.block_hash.hex()}\n".encode()


def parse(line: bytes) -> Change | None:
    """The change a line records, or None for anything else (a reader skips it)."""
    if len(line) < 4 or line[:1] not in (b"+", b"-"):
        return None
    groups, _, block_hash = line[1:].partition(b" ")
    if not groups or groups.strip(HEX_DIGITS):   # int() would take signs, spaces and 0x too
        return None
    try:
        change = Change(line[:1] == b"+", int(groups, 16), bytes.fromhex(block_hash.decode()))
    except ValueError:
        return None
    return change if change.groups > 0 and change.block_hash else None


class JournalWriter:
    """Appends this store's changes to a journal of its own (one `write` per batch, O_APPEND)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.writer_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._lock = threading.Lock()
        self._number = 0
        self._fd: int | None = None
        self._size = 0
        self._last = 0.0   # time.monotonic() of the last append
        self.names: set[str] = set()   # this writer's journals, which its own reader passes over

    def append(self, changes: Iterable[Change]) -> None:
        """OSError (a full disk) propagates: the change stays unjournaled, and the other stores find it when they
        next list the whole directory."""
        data = b"".join(change.line() for change in changes)
        if not data:
            return
        with self._lock:
            now = time.monotonic()
            if self._fd is None or self._size >= MAX_BYTES or now - self._last > IDLE_S:
                self._begin()
            assert self._fd is not None
            os.write(self._fd, data)
            self._size += len(data)
            self._last = now

    def _begin(self) -> None:
        self.close()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._number += 1
        name = f"{self.writer_id}.{self._number}{SUFFIX}"
        self._fd = os.open(self.folder / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = 0
        self.names.add(name)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class JournalReader:
    """Follows every other writer's journal in the folder from where it last read."""

    def __init__(self, folder: Path, own: set[str]) -> None:
        self.folder = folder
        self._own = own            # the writer's `names`, read as it grows
        self._offsets: dict[str, int] = {}

    def read_new(self) -> list[Change]:
        """What the other writers journaled since the last call, journal by journal."""
        try:
            names = [name for name in os.listdir(self.folder) if name.endswith(SUFFIX) and name not in self._own]
        except OSError:
            return []
        changes: list[Change] = []
        for name in names:
            offset = self._offsets.get(name, 0)
            try:
                with open(self.folder / name, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except OSError:
                continue
            whole = data.rfind(b"\n") + 1   # a line still being written waits for the next read
            for line in data[:whole].splitlines():
                if (change := parse(line)) is not None:
                    changes.append(change)
            self._offsets[name] = offset + whole
        for gone in self._offsets.keys() - set(names):
            del self._offsets[gone]
        return changes

    def remove_stale(self, now: float | None = None) -> None:
        """Remove the journals (any writer's) untouched for `KEEP_S`."""
        now = time.time() if now is None else now
        try:
            entries = list(os.scandir(self.folder))
        except OSError:
            return
        for entry in entries:
            try:
                if entry.name.endswith(SUFFIX) and now - entry.stat().st_mtime > KEEP_S:
                    os.unlink(entry.path)
            except OSError:
                pass
