"""Tiny specs, a fake request and a manager factory shared by the KV cache tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridpd.config import CacheConfig, MambaCacheMode, MambaRetentionPolicy
from hybridpd.engine.kv_cache.coordinator import KVCacheManager
from hybridpd.engine.kv_cache.memory import SharedMemory
from hybridpd.engine.kv_cache.spec import (
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)


def fa(block_size: int = 4, heads: int = 2) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=4, dtype=torch.float32)


def sw(window: int, block_size: int = 4, heads: int = 2) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=heads, head_size=4, dtype=torch.float32,
                             sliding_window=window)


def mamba(interval: int = 8) -> MambaSpec:
    return MambaSpec(block_size=interval, conv_state_shape=(3, 8), ssm_state_shape=(2, 4, 4),
                     dtypes=(torch.float32, torch.float32))


def groups_of(*specs: KVCacheSpec) -> tuple[KVCacheGroup, ...]:
    return tuple(KVCacheGroup(spec=s, layer_ids=(i,)) for i, s in enumerate(specs))


def manager(*specs: KVCacheSpec, blocks: int | tuple[int, ...] = 64, caching: bool = True,
            mode: MambaCacheMode = MambaCacheMode.ALIGN, events: bool = False,
            retention: MambaRetentionPolicy = MambaRetentionPolicy.EVERY,
            shared_cap: int | None = None, shared_share: float = 1.0) -> KVCacheManager:
    """A manager over `specs` (Mamba states saved at every boundary unless `retention` says otherwise). With
    `shared_cap`, the groups share `shared_share` of the memory that `blocks` would take (and Mamba pools grow for
    saves only below that many cached states)."""
    counts = blocks if isinstance(blocks, tuple) else (blocks,) * len(specs)
    config = CacheConfig(block_size=min(s.block_size for s in specs), enable_prefix_caching=caching,
                         mamba_cache_mode=mode, enable_kv_cache_events=events, mamba_retention=retention)
    groups = groups_of(*specs)
    if shared_cap is None:
        return KVCacheManager(groups, counts, config)
    pages = [g.page_size_bytes for g in groups]
    capacity = max(sum(pages), int(shared_share * sum((n - 1) * p for n, p in zip(counts, pages))))
    virtual = tuple(1 + capacity // g.page_size_bytes for g in groups)
    return KVCacheManager(groups, virtual, config, shared=SharedMemory(capacity=capacity, mamba_cached_cap=shared_cap))


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int = -1
    cache_salt: bytes | None = None
    skip_mamba_align: bool = False
    num_computed: int = field(default=0)

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.all_token_ids)


def prefill(m: KVCacheManager, req: Req, chunk: int | None = None) -> int:
    """Admit and prefill the whole prompt (in chunks), committing each step; returns the hit length."""
    hit = m.get_computed_blocks(req)
    first = True
    req.num_computed = hit.num_tokens
    while req.num_computed < req.num_prompt_tokens:
        n = min(chunk or req.num_prompt_tokens, req.num_prompt_tokens - req.num_computed)
        step = m.allocate_slots(req, n, hit if first else None)
        if step is None:
            raise RuntimeError("out of blocks")
        first = False
        req.num_computed += n
        m.commit(req, req.num_computed)
        m.check_invariants()
    return hit.num_tokens


def all_free(m: KVCacheManager) -> bool:
    return all(m.num_free_blocks(g) == m.num_blocks(g) for g in range(len(m.groups)))
