"""Reject a bad cache layout at construction, with a message that says what is wrong."""

from __future__ import annotations

from hybridpd.config import CacheConfig, MambaCacheMode
from hybridpd.engine.kv_cache.spec import AttentionSpec, KVCacheGroup, MambaSpec


def validate_layout(groups: tuple[KVCacheGroup, ...], num_blocks: tuple[int, ...], config: CacheConfig) -> None:
    if not groups:
        raise ValueError("a KV cache needs at least one group of layers")
    if len(groups) != len(num_blocks):
        raise ValueError(f"{len(groups)} KV cache groups but {len(num_blocks)} block counts")
    for gid, (group, n) in enumerate(zip(groups, num_blocks)):
        if n < 2:
            raise ValueError(
                f"group {gid} ({group.spec.kind}, layers {list(group.layer_ids)}) has {n} blocks; it needs at least 2 "
                f"(block 0 is the null block): give it at least {2 * group.page_size_bytes} bytes"
            )
        if not group.layer_ids:
            raise ValueError(f"group {gid} ({group.spec.kind}) has no layers")
    attention_sizes = sorted({g.spec.block_size for g in groups if isinstance(g.spec, AttentionSpec)})
    for gid, group in enumerate(groups):
        spec = group.spec
        if not isinstance(spec, MambaSpec) or config.mamba_cache_mode is not MambaCacheMode.ALIGN:
            continue
        interval = spec.block_size
        if config.mamba_cache_interval is not None and config.mamba_cache_interval != interval:
            raise ValueError(
                f"group {gid} (mamba) has cache interval {interval} but --mamba-cache-interval is "
                f"{config.mamba_cache_interval}"
            )
        bad = [b for b in attention_sizes if interval % b]
        if bad:
            raise ValueError(
                f"the Mamba cache interval {interval} (group {gid}) must be a multiple of every attention block "
                f"size, but not of {bad}"
            )
