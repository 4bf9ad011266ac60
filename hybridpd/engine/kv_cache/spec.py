"""One frozen spec per KV kind, and the grouping of layers with equal specs.

A *page* is one block of one layer; a group's page (`KVCacheGroup.page_size_bytes`) holds that block for
every layer of the group, back to back, each layer's part padded to `PAGE_ALIGN` bytes so that typed
views of it start aligned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PAGE_ALIGN = 16


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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
        raise NotImplementedError


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


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    @property
    def kind(self) -> str:
        return "full_attention"


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
