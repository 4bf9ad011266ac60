"""The storage tier as the simulator models it: one `--kv-offload-dir` shared by every simulated node (a shared
volume), holding each (group, block hash) page under `--kv-offload-size`.

What it keeps is the real tier's rule (engine/kv_offload/): every block that becomes a hit on a node is written
(`KVCacheManager.take_new_cached`: full-attention and window blocks, the Mamba states retention saves), a block
already there is not written again, and beyond the capacity the least recently written or read files go, a tenth
at a time. The real tier puts the pages a step caches at one hash into one file, evicted as one; here each page is
evicted on its own, but the pages of one hash are written in one call and mostly read in one, so they age together.
What it leaves out: writes are never dropped (the real queue drops under overload), they land at once (the real
writer is behind by a queue), and every node sees every file at once (the real nodes see others' files at their
next scan, within 5 s). The simulator's node asks it through the coordinator's own storage search (`use_storage`,
`storage_hit`, `storage_sources`), as the engine does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class SimStorage:
    def __init__(self, page_bytes: Sequence[int], capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"--kv-offload-size must be positive, got {capacity_bytes}")
        self._page_bytes = tuple(page_bytes)
        self.capacity = capacity_bytes
        self._files: OrderedDict[tuple[int, bytes], int] = OrderedDict()   # least recently used first
        self.used = 0
        self.blocks_written = self.blocks_read = self.blocks_evicted = 0
        self._changes: list[tuple[bool, int, bytes]] = []

    # -- what the coordinator asks (kv_cache/offload_hits.StorageIndex) ------------------------------------------
    def has(self, group: int, block_hash: bytes) -> bool:
        return (group, block_hash) in self._files

    @property
    def empty(self) -> bool:
        return not self._files

    # -- what a node does ---------------------------------------------------------------------------------------
    def write(self, blocks: Iterable[tuple[int, bytes]]) -> None:
        """Write behind the (group, hash) blocks that became hits; those already held are not written again."""
        for key in blocks:
            if key in self._files:
                continue
            size = self._page_bytes[key[0]]
            self._files[key] = size
            self.used += size
            self.blocks_written += 1
            self._changes.append((True, *key))
        if self.used > self.capacity:
            self._evict()

    def read(self, blocks: Iterable[tuple[int, bytes]]) -> int:
        """Read (group, hash) blocks into a node's memory: the bytes read; each becomes the most recently used."""
        read = 0
        for key in blocks:
            self._files.move_to_end(key)
            read += self._files[key]
            self.blocks_read += 1
        return read

    def take_changes(self) -> list[tuple[bool, int, bytes]]:
        """Files written (True) or evicted (False) since the last call, oldest first: the DISK KV events."""
        changes, self._changes = self._changes, []
        return changes

    def _evict(self) -> None:
        target = self.capacity * 9 // 10
        while self._files and self.used > target:
            key, size = self._files.popitem(last=False)
            self.used -= size
            self.blocks_evicted += 1
            self._changes.append((False, *key))
