"""The table from a spec kind to its manager: per-kind behaviour lives in the manager classes."""

from __future__ import annotations

from hybridpd.config import CacheConfig
from hybridpd.engine.kv_cache.block_pool import BlockPool
from hybridpd.engine.kv_cache.full_attention import FullAttentionManager
from hybridpd.engine.kv_cache.mamba import MambaManager
from hybridpd.engine.kv_cache.single_type import SingleTypeManager
from hybridpd.engine.kv_cache.sliding_window import SlidingWindowManager
from hybridpd.engine.kv_cache.spec import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec

MANAGERS: dict[type[KVCacheSpec], type[SingleTypeManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    MambaSpec: MambaManager,
}


def make_manager(spec: KVCacheSpec, pool: BlockPool, *, caching: bool, config: CacheConfig) -> SingleTypeManager:
    manager_class = MANAGERS.get(type(spec))
    if manager_class is None:
        raise ValueError(f"no KV cache manager for spec kind {type(spec).__name__}")
    return manager_class.build(spec, pool, caching=caching, config=config)
