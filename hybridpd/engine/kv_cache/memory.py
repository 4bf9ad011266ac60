"""How many blocks each group gets, from one `--kv-cache-memory` budget or an explicit attention block count.

A model with both Mamba and attention groups shares its budget (`layout_for_memory`, budget.py): nothing is set
aside per group, each group has ids for as many blocks as it could ever hold, and a Mamba running slot is paid for
when its request is admitted. The fixed split below (`blocks_for_memory`) serves the other models, and the
comparison in benchmarks/kv_capacity.py:

Every count includes the null block. One request of the max model length comes first: its attention blocks (a
window's only, for a sliding-window group) and one Mamba slot are set aside before anything else, and a budget that
cannot hold them is refused with a message naming `--kv-cache-memory` and `--max-model-len` (vLLM refuses the same
way at start-up). Running requests come next: a Mamba group gets 1 + max_num_seqs slots for running states, fewer
when the memory is tight (concurrency follows from memory, never the other way round), never fewer than 1. Of what is left, `mamba_budget` (a share, by
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
from hybridpd.engine.kv_cache.spec import KVCacheGroup, MambaSpec, SlidingWindowSpec


def _is_mamba(group: KVCacheGroup) -> bool:
    return isinstance(group.spec, MambaSpec)


def attention_bytes_per_token(groups: tuple[KVCacheGroup, ...]) -> float:
    return sum(g.page_size_bytes / g.spec.block_size for g in groups if not _is_mamba(g))


def blocks_per_request(spec, max_model_len: int) -> int:
    """Blocks one request of `max_model_len` tokens holds in an attention group at once (a window: only its own)."""
    tokens = max_model_len
    if isinstance(spec, SlidingWindowSpec):
        tokens = min(spec.sliding_window + spec.block_size, max_model_len)
    return -(-tokens // spec.block_size)


def request_attention_bytes(groups: tuple[KVCacheGroup, ...], max_model_len: int) -> int:
    return sum(blocks_per_request(g.spec, max_model_len) * g.page_size_bytes for g in groups if not _is_mamba(g))


@dataclass(frozen=True)
class _Split:
    running: int          # Mamba running slots per Mamba group
    rest: int             # bytes left after the null blocks and the running slots
    mamba_pages: int      # bytes of one slot in every Mamba group together
    attention_pages: int  # bytes of one block in every attention group together


def _check_budget(groups: tuple[KVCacheGroup, ...], memory_bytes: int, max_num_seqs: int) -> None:
    """Raises ValueError when there is no group, `max_num_seqs` < 1, or the budget cannot hold one usable block per
    group beside the null blocks."""
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


def _split(groups: tuple[KVCacheGroup, ...], memory_bytes: int, max_num_seqs: int, reserve: int = 0) -> _Split:
    """`reserve`: attention bytes set aside before the running slots (one max-length request's)."""
    _check_budget(groups, memory_bytes, max_num_seqs)
    pages = [g.page_size_bytes for g in groups]
    mamba_pages = sum(p for g, p in zip(groups, pages) if _is_mamba(g))
    attention_pages = sum(p for g, p in zip(groups, pages) if not _is_mamba(g))
    running = max_num_seqs
    if mamba_pages:
        # null + running slots for Mamba, null + one block for attention, must fit
        affordable = (memory_bytes - mamba_pages - 2 * attention_pages - reserve) // mamba_pages
        running = max(1, min(max_num_seqs, affordable))
    fixed = (1 + running) * mamba_pages + attention_pages
    return _Split(running=running, rest=memory_bytes - fixed, mamba_pages=mamba_pages, attention_pages=attention_pages)


def attention_token_limit(groups: tuple[KVCacheGroup, ...], memory_bytes: int, *, max_num_seqs: int) -> int:
    """Attention tokens `memory_bytes` would hold with the running Mamba slots set aside and no cached state."""
    per_token = attention_bytes_per_token(groups)
    return int(_split(groups, memory_bytes, max_num_seqs).rest / per_token) if per_token else 0


def _check_fits(groups: tuple[KVCacheGroup, ...], memory_bytes: int, max_model_len: int) -> int:
    """The attention bytes one request of `max_model_len` needs; raises ValueError when the budget cannot hold it
    with one Mamba slot beside (naming the flags, the memory it would need and the longest length that fits)."""
    pages = [g.page_size_bytes for g in groups]
    mamba_pages = sum(p for g, p in zip(groups, pages) if _is_mamba(g))
    fixed = 2 * mamba_pages + sum(p for g, p in zip(groups, pages) if not _is_mamba(g))   # nulls + one slot
    need = request_attention_bytes(groups, max_model_len)
    if fixed + need <= memory_bytes:
        return need
    fits = 0
    low, high = 1, max_model_len
    while low <= high:   # the longest length whose request fits: the need only grows with the length
        middle = (low + high) // 2
        if fixed + request_attention_bytes(groups, middle) <= memory_bytes:
            fits, low = middle, middle + 1
        else:
            high = middle - 1
    raise ValueError(
        f"--kv-cache-memory {memory_bytes / 2**20:.4g}MiB cannot hold one request of --max-model-len {max_model_len}: "
        f"it needs {need / 2**20:.1f} MiB of attention KV beside {fixed / 2**20:.1f} MiB for one Mamba state and the "
        f"null blocks, so give --kv-cache-memory at least {-(-(fixed + need) // 2**20)}MiB"
        + (f", or --max-model-len at most {fits}" if fits else ""))


def blocks_for_memory(groups: tuple[KVCacheGroup, ...], memory_bytes: int, *, max_num_seqs: int,
                      mamba_cache_mode: MambaCacheMode = MambaCacheMode.ALIGN,
                      mamba_budget: float = DEFAULT_MAMBA_CACHE_BUDGET,
                      max_model_len: int | None = None) -> tuple[int, ...]:
    """With `max_model_len`, one request of that length is guaranteed to fit (or ValueError says why not)."""
    reserve = _check_fits(groups, memory_bytes, max_model_len) if max_model_len is not None else 0
    split = _split(groups, memory_bytes, max_num_seqs, reserve)
    caching = mamba_cache_mode is MambaCacheMode.ALIGN and split.mamba_pages > 0
    if not split.attention_pages:  # Mamba only: every byte left holds cached states
        cached = split.rest // split.mamba_pages if caching else 0
        return tuple(1 + split.running + cached for _ in groups)
    cached = int(split.rest * mamba_budget) // split.mamba_pages if caching else 0
    room = split.rest - max(split.attention_pages, reserve)   # the cached states never take the reserved request's
    cached = min(cached, max(0, room // split.mamba_pages) if caching else 0)
    tokens = int((split.rest - cached * split.mamba_pages) / attention_bytes_per_token(groups))
    return tuple(
        1 + split.running + cached if _is_mamba(g) else 1 + max(1, tokens // g.spec.block_size) for g in groups
    )


@dataclass(frozen=True)
class SharedMemory:
    """Pools that draw from one budget of `capacity` bytes (the null blocks beside it). A best-effort Mamba save takes
    another group's cached block only while its pool holds fewer than `mamba_cached_cap` cached states
    (`--mamba-cache-budget` of the bytes)."""

    capacity: int
    mamba_cached_cap: int


@dataclass(frozen=True)
class KVLayout:
    """Block ids per group (null included) and, when the groups share their memory, the budget they share."""

    num_blocks: tuple[int, ...]
    shared: SharedMemory | None = None


def layout_for_memory(groups: tuple[KVCacheGroup, ...], memory_bytes: int, *, max_num_seqs: int,
                      mamba_cache_mode: MambaCacheMode = MambaCacheMode.ALIGN,
                      mamba_budget: float = DEFAULT_MAMBA_CACHE_BUDGET,
                      max_model_len: int | None = None) -> KVLayout:
    """Shared memory for a model with Mamba and attention groups: a Mamba group's ids cover every byte but one block
    of each attention group, an attention group's the tokens every attention group could hold at once; with
    `max_model_len`, one request of that length must fit (else ValueError says what would). Other models get
    `blocks_for_memory`'s fixed counts."""
    mamba_pages = sum(g.page_size_bytes for g in groups if _is_mamba(g))
    attention_pages = sum(g.page_size_bytes for g in groups if not _is_mamba(g))
    if not (mamba_pages and attention_pages):
        return KVLayout(blocks_for_memory(groups, memory_bytes, max_num_seqs=max_num_seqs,
                                          mamba_cache_mode=mamba_cache_mode, mamba_budget=mamba_budget,
                                          max_model_len=max_model_len))
    _check_budget(groups, memory_bytes, max_num_seqs)
    if max_model_len is not None:
        _check_fits(groups, memory_bytes, max_model_len)
    capacity = memory_bytes - mamba_pages - attention_pages   # the null blocks are set aside
    caching = mamba_cache_mode is MambaCacheMode.ALIGN
    # an attention group never needs more tokens than every attention group could hold at once beside one Mamba slot
    # (nor fewer than one request of the max length)
    tokens = max(int((capacity - mamba_pages) / attention_bytes_per_token(groups)), max_model_len or 0)
    counts = tuple(
        1 + (capacity - attention_pages) // mamba_pages if _is_mamba(g) else 1 + max(1, -(-tokens // g.spec.block_size))
        for g in groups
    )
    cap = int(capacity * mamba_budget) // mamba_pages if caching else 0
    return KVLayout(counts, SharedMemory(capacity=capacity, mamba_cached_cap=cap))


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
