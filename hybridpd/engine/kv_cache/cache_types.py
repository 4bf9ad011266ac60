"""The values the KV cache manager hands to the engine (re-exported by `coordinator`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class CacheRequest(Protocol):
    """What the cache reads of a request; the engine's Request satisfies it."""

    request_id: str
    all_token_ids: Sequence[int]   # prompt + generated so far (only grows)
    num_prompt_tokens: int
    cache_salt: bytes | None
    skip_mamba_align: bool         # remotely prefilled: only full-attention groups decide the hit


@dataclass(frozen=True, kw_only=True)
class CacheHit:
    """The local prefix hit: `num_tokens` < num_prompt_tokens, a multiple of the deciding groups' LCM."""

    num_tokens: int
    blocks: tuple[tuple[int, ...], ...]   # per group, the hit's block ids (for allocate_slots)
    shared_tokens: int = 0                # the prefix the full-attention groups alone hold (>= num_tokens)


@dataclass(frozen=True, kw_only=True)
class MambaStepOps:
    state_slot: int                       # the request's running state slot
    copy_from: int | None                 # a cached state slot to copy into state_slot before this step
    saves: tuple[tuple[int, int], ...]    # (num_tokens, slot): write the state after tokens [0, num_tokens)


@dataclass(frozen=True, kw_only=True)
class StepBlocks:
    block_tables: tuple[tuple[int, ...], ...]       # per group; attention: logical block -> id; Mamba: (slot,)
    mamba: tuple[MambaStepOps | None, ...]          # per group; None for attention groups
    load: tuple[tuple[tuple[int, int], ...], ...]   # per group: (logical block, local id) to fill from remote


@dataclass(frozen=True, kw_only=True)
class GroupStats:
    group_id: int
    kind: str
    queries: int          # prefix lookups
    query_tokens: int     # prompt tokens looked up
    hit_tokens: int       # tokens this group served from its cache
    num_free: int         # free blocks (cached ones included: they are evictable)
    num_total: int        # usable blocks (null block excluded)
    num_cached: int       # blocks holding a hash (free or held)
