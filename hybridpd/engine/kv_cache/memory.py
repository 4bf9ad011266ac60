"""How many blocks each group gets, from one `--kv-cache-memory` budget or an explicit attention block count.

Every count includes the null block. Running requests come first: a Mamba group gets 1 + max_num_seqs slots for
running states (fewer if the memory is tight, never fewer than 1). Of what is left, `mamba_budget` (a share, by
default 10%) buys cached Mamba states, the same number in every Mamba group (a cached prefix needs a state in
each), in `align` mode only; the attention groups share the rest so that each can hold the same number of tokens
(a token costs page/block_size bytes in each attention group). Which states fill those slots is the retention
policy's and the LRU's business (retention.py), not one slot per interval of attention tokens: on published
shapes a saved state costs tens of times the attention KV of its interval, so that rule left attention little.

The physical limit a policy is measured against (`attention_token_limit`): the attention tokens the memory would
hold with the running Mamba slots set aside and no cached Mamba state at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridpd.config import DEFAULT_MAMBA_CACHE_BUDGET, MambaCacheMode
from hybridpd.engine.kv_cache.spec import KVCacheGroup, MambaSpec


def _is_mamba(group: KVCacheGroup) -> bool:
    return isinstance(group.spec, MambaSpec)


def attention_bytes_per_token(groups: tuple[KVCacheGroup, ...]) -> float:
    return sum(g.page_size_bytes / g.spec.block_size for g in groups if not _is_mamba(g))


@dataclass(frozen=True)
class _Split:
    running: int          # Mamba running slots per Mamba group
    rest: int             # bytes left after the null blocks and the running slots
    mamba_pages: int      # bytes of one slot in every Mamba group together
    attention_pages: int  # bytes of one block in every attention group together


def _split(groups: tuple[KVCacheGroup, ...], memory_bytes: int, max_num_seqs: int) -> _Split:
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
    fixed = (1 + running) * mamba_pages + attention_pages
    return _Split(running=running, rest=memory_bytes - fixed, mamba_pages=mamba_pages, attention_pages=attention_pages)


def attention_token_limit(groups: tuple[KVCacheGroup, ...], memory_bytes: int, *, max_num_seqs: int) -> int:
    """Attention tokens `memory_bytes` would hold with the running Mamba slots set aside and no cached state."""
    per_token = attention_bytes_per_token(groups)
    return int(_split(groups, memory_bytes, max_num_seqs).rest / per_token) if per_token else 0


def blocks_for_memory(groups: tuple[KVCacheGroup, ...], memory_bytes: int, *, max_num_seqs: int,
                      mamba_cache_mode: MambaCacheMode = MambaCacheMode.ALIGN,
                      mamba_budget: float = DEFAULT_MAMBA_CACHE_BUDGET) -> tuple[int, ...]:
    split = _split(groups, memory_bytes, max_num_seqs)
    caching = mamba_cache_mode is MambaCacheMode.ALIGN and split.mamba_pages > 0
    if not split.attention_pages:  # Mamba only: every byte left holds cached states
        cached = split.rest // split.mamba_pages if caching else 0
        return tuple(1 + split.running + cached for _ in groups)
    cached = int(split.rest * mamba_budget) // split.mamba_pages if caching else 0
    cached = min(cached, max(0, (split.rest - split.attention_pages) // split.mamba_pages) if caching else 0)
    tokens = int((split.rest - cached * split.mamba_pages) / attention_bytes_per_token(groups))
    return tuple(
        1 + split.running + cached if _is_mamba(g) else 1 + max(1, tokens // g.spec.block_size) for g in groups
    )


def blocks_for_count(groups: tuple[KVCacheGroup, ...], num_blocks: int, *, max_num_seqs: int,
                     mamba_cache_mode: MambaCacheMode = MambaCacheMode.ALIGN,
                     mamba_budget: float = DEFAULT_MAMBA_CACHE_BUDGET) -> tuple[int, ...]:
    """`num_blocks` (null included) for every attention group; Mamba groups get running slots plus cached-state
    slots worth `mamba_budget` of the cache beyond the running slots (or `num_blocks - 1` without attention)."""
    if num_blocks < 2:
        raise ValueError(f"--num-blocks must be >= 2 (one is the null block), got {num_blocks}")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    mamba_pages = sum(g.page_size_bytes for g in groups if _is_mamba(g))
    attention_bytes = (num_blocks - 1) * sum(g.page_size_bytes for g in groups if not _is_mamba(g))
    if mamba_cache_mode is not MambaCacheMode.ALIGN or not mamba_pages:
        cached = 0
    elif not attention_bytes:
        cached = num_blocks - 1
    else:
        cached = int(attention_bytes * mamba_budget / (1 - mamba_budget)) // mamba_pages
    return tuple(1 + max_num_seqs + cached if _is_mamba(g) else num_blocks for g in groups)
