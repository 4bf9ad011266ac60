"""Writing block files: the pages of one block hash into one file, atomically (a temporary file in the same folder,
renamed into place), unless files another writer made already hold them. No index and no journal here: the caller
records what was written (the store in-process, the tier from its writer process's answers)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from hybridpd.engine.kv_offload import block_file
from hybridpd.engine.kv_offload.layout import GroupLayout, block_path, union


@dataclass(frozen=True)
class Written:
    written: int              # the groups whose pages this write put in a new file (0: none)
    found: tuple[int, ...]    # the groups of each file of the block found there already (another writer's)


class BlockFileWriter:
    def __init__(self, folder: str, model_key: bytes, groups: Sequence[GroupLayout]) -> None:
        self.folder = folder
        self.model_key = model_key
        self.groups = tuple(groups)
        self._shards: set[str] = set()   # shard folders known to exist

    def write(self, block_hash: bytes, pages: Sequence[tuple[int, memoryview]], masks: Sequence[int]) -> Written:
        """Write `pages` ((group, payload), distinct groups) of the block into one file, leaving out the groups files
        of the block already hold. The nodes of a cluster write the same prefixes moments apart, each with the groups
        its own step cached (a decode node's pulled blocks lack the sliding-window groups, say), so before writing it
        looks for the block under each set of groups in `masks` (the sets files have been seen with, the largest
        first: a stat each, a few) and under the set it would write. OSError (a full disk, a read-only volume)
        propagates; ValueError for a page of the wrong size or a group given twice."""
        groups = 0
        for group, payload in pages:
            if groups >> group & 1 or payload.nbytes != self.groups[group].page_bytes:
                raise ValueError(f"group {group}'s page given twice, or not of {self.groups[group].page_bytes} bytes")
            groups |= 1 << group
        found = self._elsewhere(block_hash, groups, masks)
        groups &= ~union(found)
        if not groups:
            return Written(0, found)
        pages = sorted(((group, payload) for group, payload in pages if groups >> group & 1), key=lambda p: p[0])
        path = block_path(self.folder, block_hash, groups)
        shard = path[: path.rindex("/")]
        if shard not in self._shards:
            os.makedirs(shard, exist_ok=True)
            self._shards.add(shard)
        temp = f"{shard}/.{block_hash.hex()}.{os.getpid()}.{threading.get_ident()}.tmp"   # one per writer thread
        header = block_file.encode_header(self.model_key, block_hash,
                                          [(self.groups[group].key, payload) for group, payload in pages])
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.writev(fd, [header, *(payload for _, payload in pages)])
            finally:
                os.close(fd)
            os.replace(temp, path)
        except BaseException:
            try:
                os.unlink(temp)
            except OSError:
                pass
            raise
        return Written(groups, found)

    def _elsewhere(self, block_hash: bytes, groups: int, masks: Sequence[int]) -> tuple[int, ...]:
        """The groups of each file of the block that exists and holds some of `groups` not found before it."""
        found, covered = [], 0
        for mask in masks if groups in masks else (*masks, groups):
            if mask & groups & ~covered and os.path.exists(block_path(self.folder, block_hash, mask)):
                found.append(mask)
                covered |= mask
                if not groups & ~covered:
                    break
        return tuple(found)
