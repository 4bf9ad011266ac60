"""`NemotronHConfig`: a `NemotronHForCausalLM` config.json read the way transformers 5.x reads it.

Layers come from `layers_block_type` (`linear_attention`/`mamba`, `full_attention`/`attention`, `mlp`, `moe`) or
from the legacy `hybrid_override_pattern` string (`M` Mamba2, `*` attention, `-` MLP, `E` MoE); each layer is a norm,
one mixer and a residual. Defaults are transformers' `NemotronHConfig` defaults; its Mamba-side aliases
(`mamba_n_groups`, `mamba_d_conv`, `mamba_chunk_size`, ...) are accepted. The shared attention and Mamba2 layers
are built from their shapes (shapes.py): no RoPE, softmax scale head_dim^-0.5, no multipliers, and Mamba's dt clamped
below at `time_step_min` (transformers' Nemotron-H mixer ignores `time_step_limit`). The two extension keys (`kv_heads_per_layer`,
`sliding_window_per_layer`) apply to the attention layers as in Granite.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from hybridpd.engine.model.config_fields import int_field, per_layer_list, token_and_dtype_fields
from hybridpd.engine.model.shapes import AttentionShape, Mamba2Shape


class BlockType(enum.Enum):
    MAMBA = "mamba"
    ATTENTION = "attention"
    MLP = "mlp"
    MOE = "moe"


_BLOCK_NAMES = {
    "linear_attention": BlockType.MAMBA, "mamba": BlockType.MAMBA,
    "full_attention": BlockType.ATTENTION, "attention": BlockType.ATTENTION,
    "mlp": BlockType.MLP, "moe": BlockType.MOE,
}
_PATTERN = {"M": BlockType.MAMBA, "*": BlockType.ATTENTION, "-": BlockType.MLP, "E": BlockType.MOE}
_ACTIVATIONS = ("relu2",)


@dataclass(frozen=True, kw_only=True)
class NemotronHConfig:
    vocab_size: int
    hidden_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]       # every listed id stops generation
    checkpoint_dtype: str
    block_types: tuple[BlockType, ...]
    attention: tuple[AttentionShape | None, ...]   # per layer: the shape of an attention layer, else None
    mamba: Mamba2Shape
    intermediate_size: int               # of an MLP layer
    mlp_bias: bool
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    def __post_init__(self) -> None:
        if BlockType.MOE in self.block_types:
            if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
                raise ValueError(f"num_experts_per_tok must be in 1..n_routed_experts ({self.n_routed_experts}), "
                                 f"got {self.num_experts_per_tok}")
            if self.n_group < 1 or self.n_routed_experts % self.n_group:
                raise ValueError(f"n_group ({self.n_group}) must divide n_routed_experts ({self.n_routed_experts})")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"topk_group must be in 1..n_group ({self.n_group}), got {self.topk_group}")
            if self.n_routed_experts // self.n_group < 2:
                raise ValueError("each expert group needs at least 2 experts (the group score sums the top 2)")

    @property
    def mamba_chunk_size(self) -> int:
        return self.mamba.chunk_size

    @property
    def has_mamba(self) -> bool:
        return BlockType.MAMBA in self.block_types

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> NemotronHConfig:
        return parse_nemotron_h(raw)


def _block_types(raw: dict[str, Any]) -> tuple[BlockType, ...]:
    listed = raw.get("layers_block_type", raw.get("layer_types"))
    if listed is not None:
        if not isinstance(listed, list) or not listed:
            raise ValueError(f"layers_block_type must be a non-empty list, got {listed!r}")
        unknown = sorted({str(t) for t in listed if t not in _BLOCK_NAMES})
        if unknown:
            raise ValueError(f"layers_block_type has unknown entries {unknown}; supported: {sorted(_BLOCK_NAMES)}")
        return tuple(_BLOCK_NAMES[t] for t in listed)
    pattern = raw.get("hybrid_override_pattern")
    if pattern is None:  # transformers' default
        return (BlockType.MAMBA, BlockType.MOE, BlockType.ATTENTION, BlockType.MLP)
    if not isinstance(pattern, str) or not pattern or any(c not in _PATTERN for c in pattern):
        raise ValueError(f"hybrid_override_pattern {pattern!r} is not supported; supported: a string of M * - E")
    return tuple(_PATTERN[c] for c in pattern)


def parse_nemotron_h(raw: dict[str, Any]) -> NemotronHConfig:
    for key, value, supported in (("mlp_hidden_act", raw.get("mlp_hidden_act", "relu2"), _ACTIVATIONS),
                                  ("mamba_hidden_act", raw.get("mamba_hidden_act", "silu"), ("silu",))):
        if value not in supported:
            raise ValueError(f"{key} {value!r} is not supported; supported: {', '.join(supported)}")
    if raw.get("moe_latent_size") is not None:
        raise ValueError(f"moe_latent_size {raw['moe_latent_size']!r} is not supported; supported: null")
    if raw.get("num_nextn_predict_layers"):
        raise ValueError(f"num_nextn_predict_layers {raw['num_nextn_predict_layers']!r} is not supported; "
                         "supported: 0 (multi-token prediction layers are not served)")
    if raw.get("attention_bias"):
        raise ValueError("attention_bias true is not supported; supported: false (transformers' Nemotron-H has none)")
    blocks = _block_types(raw)
    num_layers = len(blocks)
    is_attention = tuple(b is BlockType.ATTENTION for b in blocks)
    hidden = int_field(raw, "hidden_size", 4096)
    heads = int_field(raw, "num_attention_heads", 32)
    kv_heads = int_field(raw, "num_key_value_heads", heads)
    head_dim = int_field(raw, "head_dim", 128)
    kv_per_layer = per_layer_list(raw, "kv_heads_per_layer", num_layers)
    windows = per_layer_list(raw, "sliding_window_per_layer", num_layers)
    n_heads = int_field(raw, "mamba_num_heads", 128)
    d_head = int_field(raw, "mamba_head_dim", 64)
    step_min = raw.get("time_step_min", raw.get("mamba_dt_min", 0.001))
    if isinstance(step_min, bool) or not isinstance(step_min, (int, float)) or step_min < 0:
        raise ValueError(f"time_step_min must be a non-negative number, got {step_min!r}")
    eps = float(raw.get("layer_norm_epsilon", 1e-5))
    attention = []
    for layer, (attn, kv, window) in enumerate(zip(is_attention, kv_per_layer, windows)):
        try:
            attention.append(AttentionShape(
                hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads if kv is None else kv, head_dim=head_dim,
                sliding_window=window, scale=head_dim ** -0.5, bias=False,
            ) if attn else None)
        except ValueError as exc:
            raise ValueError(f"layer {layer}: {exc}") from None
    mamba = Mamba2Shape(
        hidden_size=hidden, n_heads=n_heads, d_head=d_head,
        n_groups=int_field(raw, "n_groups", int_field(raw, "mamba_n_groups", 8)),
        d_state=int_field(raw, "ssm_state_size", 128),
        d_conv=int_field(raw, "conv_kernel", int_field(raw, "mamba_d_conv", 4)),
        chunk_size=int_field(raw, "chunk_size", int_field(raw, "mamba_chunk_size", 128)),
        conv_bias=bool(raw.get("use_conv_bias", raw.get("mamba_conv_bias", True))),
        in_proj_bias=bool(raw.get("use_bias", False)), out_proj_bias=bool(raw.get("use_bias", False)),
        time_step_limit=(float(step_min), math.inf), norm_eps=eps,
    )
    return NemotronHConfig(
        vocab_size=int_field(raw, "vocab_size", 131072),
        hidden_size=hidden,
        max_position_embeddings=int_field(raw, "max_position_embeddings", 4096),
        rms_norm_eps=eps,
        **token_and_dtype_fields(raw),
        block_types=blocks,
        attention=tuple(attention),
        mamba=mamba,
        intermediate_size=int_field(raw, "intermediate_size", 21504),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        n_routed_experts=int_field(raw, "n_routed_experts", 8),
        num_experts_per_tok=int_field(raw, "num_experts_per_tok", 2),
        moe_intermediate_size=int_field(raw, "moe_intermediate_size", 7688),
        moe_shared_expert_intermediate_size=int_field(raw, "moe_shared_expert_intermediate_size", 7688),
        n_group=int_field(raw, "n_group", 1),
        topk_group=int_field(raw, "topk_group", 1),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
    )
