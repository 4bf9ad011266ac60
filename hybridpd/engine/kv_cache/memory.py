"""How many blocks each group gets, from one `--kv-cache-memory` budget or an explicit attention block count.

Every count includes the null block. A Mamba group gets 1 + max_num_seqs slots for running states (fewer if
the budget is tight, never fewer than 1) plus, in `align` mode, one cached-state slot per interval of the
tokens the attention groups can hold. The attention groups then share what is left so that each can hold the
same number of tokens: a token costs page/block_size bytes in each attention group (and page/interval in each
Mamba group for its cached states), and the budget buys that many tokens.
"""

from __future__ import annotations

from hybridpd.config import MambaCacheMode
from hybridpd.engine.kv_cache.spec import KVCacheGroup, MambaSpec


def _is_mamba(group: KVCacheGroup) -> bool:
    return isinstance(group.spec, MambaSpec)


def blocks_for_memory(groups: tuple[KVCacheGroup, ...], memory_bytes: int, *, max_num_seqs: int,
                      mamba_cache_mode: MambaCacheMode = MambaCacheMode.ALIGN) -> tuple[int, ...]:
    if not groups:
        raise ValueError("no KV cache groups to give memory to")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    pages = [g.page_size_bytes for g in groups]
    minimum = 2 * sum(pages)
    if memory_bytes < minimum:
        detail = ", ".join(f"group {i} ({g.spec.kind}) {p} B" for i, (g, p) in enumerate(zip(groups, pages)))
        raise ValueError(
            f"--kv-cache-memory {memory_bytes} B cannot hold one usable block per group plus the null block: one "
            f"block per group needs {sum(pages)} B ({detail}), so give at least {minimum} B"
        )
    mamba_pages = sum(p for g, p in zip(groups, pages) if _is_mamba(g))
    attention_pages = sum(p for g, p in zip(groups, pages) if not _is_mamba(g))
    running = max_num_seqs
    if mamba_pages:
        # null + running slots for Mamba, null + one block for attention, must fit
        affordable = (memory_bytes - mamba_pages - 2 * attention_pages) // mamba_pages
        running = max(1, min(max_num_seqs, affordable))
    fixed = sum((2 + running - 1 if _is_mamba(g) else 1) * p for g, p in zip(groups, pages))
    cost_per_token = sum(
        p / g.spec.block_size
        for g, p in zip(groups, pages)
        if not _is_mamba(g) or mamba_cache_mode is MambaCacheMode.ALIGN
    )
    tokens = int((memory_bytes - fixed) / cost_per_token) if cost_per_token else 0
    counts = []
    for g in groups:
        if _is_mamba(g):
            cached = tokens // g.spec.block_size if mamba_cache_mode is MambaCacheMode.ALIGN else 0
            counts.append(1 + running + cached)
        else:
            counts.append(1 + max(1, tokens // g.spec.block_size))
    return tuple(counts)


def blocks_for_count(groups: tuple[KVCacheGroup, ...], num_blocks: int, *, max_num_seqs: int,
                     mamba_cache_mode: MambaCacheMode = MambaCacheMode.ALIGN) -> tuple[int, ...]:
    """`num_blocks` (null included) for every attention group; Mamba groups get running slots plus cached-state
    slots for the tokens the smallest attention group holds (or `num_blocks - 1` of them without attention)."""
    if num_blocks < 2:
        raise ValueError(f"--num-blocks must be >= 2 (one is the null block), got {num_blocks}")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    attention_sizes = [g.spec.block_size for g in groups if not _is_mamba(g)]
    tokens = (num_blocks - 1) * min(attention_sizes) if attention_sizes else None
    counts = []
    for g in groups:
        if not _is_mamba(g):
            counts.append(num_blocks)
            continue
        if mamba_cache_mode is not MambaCacheMode.ALIGN:
            cached = 0
        else:
            cached = tokens // g.spec.block_size if tokens is not None else num_blocks - 1
        counts.append(1 + max_num_seqs + cached)
    return tuple(counts)
