"""Per-step metadata, computed once per forward and shared by every layer of a KV group (attention_meta.py,
mamba_meta.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridpd.engine.kv_cache.spec import AttentionSpec, KVCacheGroup, MambaSpec
from hybridpd.engine.model.step.attention_meta import AttentionGroupMeta, DecodeLayout, attention_group_meta
from hybridpd.engine.model.step.decode_kv import DecodeKV
from hybridpd.engine.model.step.forward_batch import ForwardBatch
from hybridpd.engine.model.step.mamba_meta import MambaRows, mamba_group_meta


@dataclass(frozen=True)
class StepContext:
    rope_cos: torch.Tensor | None  # [T, 1, head_dim]
    rope_sin: torch.Tensor | None
    groups: tuple[AttentionGroupMeta | MambaRows, ...]
    decode_kv: DecodeKV | None = None  # the buffers the groups' DecodeKVPlans refer to


def build_step_context(
    batch: ForwardBatch, groups: Sequence[KVCacheGroup],
    rope: tuple[torch.Tensor, torch.Tensor] | None, decode_kv: DecodeKV | None = None,
) -> StepContext:
    """Every group's metadata for one step. Groups of one kind with equal block sizes and windows (two full
    attention groups with different KV heads, say) share what depends only on the positions: built once.
    With `decode_kv`, the decode rows of attention groups read contiguous buffers (decode_kv.py)."""
    shared: dict[tuple, DecodeLayout] = {}
    return StepContext(
        rope_cos=None if rope is None else rope[0], rope_sin=None if rope is None else rope[1],
        groups=tuple(
            build_group_meta(batch, g, group, shared, decode_kv) for g, group in enumerate(groups)
        ),
        decode_kv=decode_kv,
    )


def build_group_meta(
    batch: ForwardBatch, group_id: int, group: KVCacheGroup,
    shared: dict[tuple, DecodeLayout] | None = None, decode_kv: DecodeKV | None = None,
) -> AttentionGroupMeta | MambaRows:
    spec = group.spec
    if isinstance(spec, AttentionSpec):
        return attention_group_meta(batch, group_id, spec, shared, decode_kv)
    if isinstance(spec, MambaSpec):
        return mamba_group_meta(batch, group_id, spec)
    raise TypeError(f"no model support for KV spec {type(spec).__name__}")
