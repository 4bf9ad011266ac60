"""One frozen spec per KV kind, and the grouping of layers with equal specs.

A spec carries its kind's rules: which prefix lengths its cached blocks can serve (`hit_rule`, hit_rules.py) and
which blocks of a prefix a decode node needs (`needed_span`). A new kind is a spec class here, a manager class, and
a line in managers.py's table.

A *page* is one block of one layer; a group's page (`KVCacheGroup.page_size_bytes`) holds that block for
every layer of the group, back to back, each layer's part padded to `PAGE_ALIGN` bytes so that typed
views of it start aligned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridpd.engine.kv_cache.hit_rules import FullAttentionRule, HitRule, MambaRule, SlidingWindowRule

PAGE_ALIGN = 16


def dtype_size(dtype: torch.dtype) -> int:
    return dtype.itemsize   # (a tensor's element_size made a tensor per call: ~1 us, per group and step)


def align_up(n: int, alignment: int = PAGE_ALIGN) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """`block_size` is the number of tokens one block stands for (the hit granularity of this kind)."""

    block_size: int

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer, padded to PAGE_ALIGN."""
        raise NotImplementedError

    @property
    def kind(self) -> str:
        """The kind's name, as KV events carry it."""
        raise NotImplementedError

    def hit_rule(self) -> HitRule:
        """Which prefix lengths this kind can serve from its cached blocks."""
        raise NotImplementedError

    def needed_span(self, num_tokens: int) -> tuple[int, int]:
        """[start, end) of the logical blocks (Mamba: state slots) a decode node needs of tokens [0, num_tokens):
        it computes token `num_tokens` itself."""
        raise NotImplementedError

    def hash_index(self, logical: int, num_tokens: int) -> int:
        """Which entry of the request's hash chain names logical block `logical` of a prefix of `num_tokens`."""
        return logical


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_kv_heads < 1 or self.head_size < 1:
            raise ValueError(f"num_kv_heads and head_size must be >= 1, got {self.num_kv_heads}, {self.head_size}")

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        """Shape of one layer's page viewed as `dtype`: (K|V, block_size, num_kv_heads, head_size)."""
        return (2, self.block_size, self.num_kv_heads, self.head_size)

    @property
    def page_size_bytes(self) -> int:
        return align_up(math.prod(self.kv_shape) * dtype_size(self.dtype))

    def needed_span(self, num_tokens: int) -> tuple[int, int]:
        """Every block."""
        return 0, -(-num_tokens // self.block_size)


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    @property
    def kind(self) -> str:
        return "full_attention"

    def hit_rule(self) -> HitRule:
        return FullAttentionRule(self.block_size)


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Query i sees key j iff i - sliding_window < j <= i."""

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def kind(self) -> str:
        return "sliding_window"

    def hit_rule(self) -> SlidingWindowRule:
        return SlidingWindowRule(self.block_size, self.sliding_window)

    def needed_span(self, num_tokens: int) -> tuple[int, int]:
        """The query at `num_tokens` sees keys j > num_tokens - W: the blocks from `max(0, n + 1 - W) // b` on."""
        end = -(-num_tokens // self.block_size)
        return min(max(0, num_tokens + 1 - self.sliding_window) // self.block_size, end), end


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """One block is one state slot: the conv state then the ssm state of a layer.

    `block_size` is the Mamba cache interval: a cached state stands for a prefix that is a multiple of it.
    """

    conv_state_shape: tuple[int, ...]
    ssm_state_shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, torch.dtype]

    @property
    def conv_bytes(self) -> int:
        return align_up(math.prod(self.conv_state_shape) * dtype_size(self.dtypes[0]))

    @property
    def page_size_bytes(self) -> int:
        return align_up(self.conv_bytes + math.prod(self.ssm_state_shape) * dtype_size(self.dtypes[1]))

    @property
    def kind(self) -> str:
        return "mamba"

    def hit_rule(self) -> HitRule:
        return MambaRule(self.block_size)

    def needed_span(self, num_tokens: int) -> tuple[int, int]:
        """Its one state slot."""
        return (0, 1) if num_tokens > 0 else (0, 0)

    def hash_index(self, logical: int, num_tokens: int) -> int:
        """The one slot holds the state after `num_tokens`, saved under hash number num_tokens / interval - 1."""
        return num_tokens // self.block_size - 1


@dataclass(frozen=True, kw_only=True)
class KVCacheGroup:
    """Layers with equal specs; their blocks live in one `(num_blocks, page_size_bytes)` int8 tensor."""

    spec: KVCacheSpec
    layer_ids: tuple[int, ...]

    @property
    def page_size_bytes(self) -> int:
        return self.spec.page_size_bytes * len(self.layer_ids)


def group_layers(layer_specs: dict[int, KVCacheSpec]) -> tuple[KVCacheGroup, ...]:
    """Layers with equal specs form one group; groups are ordered by their first layer (a wire contract)."""
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for layer_id in sorted(layer_specs):
        by_spec.setdefault(layer_specs[layer_id], []).append(layer_id)
    groups = [KVCacheGroup(spec=spec, layer_ids=tuple(ids)) for spec, ids in by_spec.items()]
    return tuple(sorted(groups, key=lambda g: g.layer_ids[0]))
