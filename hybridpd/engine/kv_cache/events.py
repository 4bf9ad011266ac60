"""What the prefix cache reports as it changes: the engine-side KV cache events (no wire format here).

`BlockStored`: blocks of one group became hits under these hashes (consecutive blocks of one request's chain:
`parent_block_hash` is the hash before the first, `token_ids` the tokens they cover). `BlockRemoved`: hashes of one
group that are no longer hits (evicted or reset). A Mamba group's block is one saved state: its hash is the chain
hash of the prefix it stands for, `block_size` its interval. Events are in the order the cache changed, so a
consumer that applies them in order holds exactly the set of hashes each group can serve, per medium: the memory
pool (vLLM's name for its primary tier, "GPU") or the storage tier ("DISK"; `AllBlocksCleared` clears memory only).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hybridpd.engine.kv_cache.hashing import BlockHash


class Medium(enum.Enum):
    MEMORY = "GPU"     # vLLM's name for the primary KV tier on every platform, its CPU build too
    STORAGE = "DISK"   # the storage tier (--kv-offload-dir)


@dataclass(frozen=True, kw_only=True)
class BlockStored:
    group_idx: int
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]    # empty for the storage tier, which knows blocks by hash alone
    block_size: int
    medium: Medium = Medium.MEMORY


@dataclass(frozen=True, kw_only=True)
class BlockRemoved:
    group_idx: int
    block_hashes: tuple[BlockHash, ...]
    medium: Medium = Medium.MEMORY


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
