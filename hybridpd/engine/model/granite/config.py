"""`GraniteConfig`: a `GraniteMoeHybridForCausalLM` (Granite-4.0-H) `config.json`.

Read the way transformers 5.x's GraniteMoeHybrid reads it (defaults included; its JSON encoding of non-finite floats,
`{"__float__": "Infinity"}`; `rope_parameters` or the legacy `rope_theta`/`rope_scaling`; `dtype` or `torch_dtype`;
`eos_token_id` as one id or a list), dense or MoE (`num_local_experts > 0`), plus two extension keys:
- `kv_heads_per_layer`: list, `null` entries = `num_key_value_heads` (ignored for Mamba layers);
- `sliding_window_per_layer`: list, `null` = full attention; query i sees key j iff i - W < j <= i.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from hybridpd.engine.model.config_fields import (
    float_or_one, int_field, per_layer_list, rope_theta, time_step_limit, token_and_dtype_fields,
)
from hybridpd.engine.model.shapes import AttentionShape, Mamba2Shape


class LayerKind(enum.Enum):
    MAMBA = "mamba"
    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"


# Both spellings: published Granite-4.0-H configs, and what transformers 5.x writes.
_LAYER_TYPE_NAMES = {
    "mamba": False,
    "linear_attention": False,
    "attention": True,
    "full_attention": True,
}


@dataclass(frozen=True, kw_only=True)
class GraniteConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    shared_intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    attention_bias: bool
    # Granite's multipliers
    embedding_multiplier: float
    attention_multiplier: float   # the softmax scale
    residual_multiplier: float
    logits_scaling: float         # a divisor of the logits
    position_embedding_type: str | None   # "rope" or None
    rope_theta: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]   # every listed id stops generation
    checkpoint_dtype: str            # the dtype the weights were saved in (`dtype` / `torch_dtype`)
    # MoE (num_local_experts == 0: dense, the shared MLP only)
    num_local_experts: int
    num_experts_per_tok: int
    intermediate_size: int           # of each expert
    # per layer
    layer_is_attention: tuple[bool, ...]
    kv_heads_per_layer: tuple[int, ...]              # num_key_value_heads resolved per layer (0 for Mamba layers)
    sliding_window_per_layer: tuple[int | None, ...]  # None = full attention (always None for Mamba layers)
    # Mamba2
    mamba_n_heads: int
    mamba_n_groups: int
    mamba_d_state: int
    mamba_d_head: int
    mamba_d_conv: int
    mamba_expand: int
    mamba_chunk_size: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool
    time_step_limit: tuple[float, float]

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        for name in ("layer_is_attention", "kv_heads_per_layer", "sliding_window_per_layer"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, num_hidden_layers is {n}")
        for name in ("vocab_size", "hidden_size", "num_attention_heads", "head_dim", "shared_intermediate_size",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.position_embedding_type not in (None, "rope"):
            raise ValueError(f"position_embedding_type must be 'rope' or null, got {self.position_embedding_type!r}")
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        for layer, is_attn in enumerate(self.layer_is_attention):
            try:
                self.attention_shape(layer) if is_attn else None
            except ValueError as exc:
                raise ValueError(f"layer {layer}: {exc}") from None
        if self.has_mamba:
            _ = self.mamba_shape  # checked by its own rules
        if self.num_local_experts < 0:
            raise ValueError(f"num_local_experts must be >= 0, got {self.num_local_experts}")
        if self.num_local_experts and not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(
                f"num_experts_per_tok must be in 1..num_local_experts ({self.num_local_experts}), "
                f"got {self.num_experts_per_tok}"
            )
        if self.num_local_experts and self.intermediate_size < 1:
            raise ValueError(f"intermediate_size must be >= 1 with experts, got {self.intermediate_size}")

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(
            LayerKind.MAMBA if not attn
            else LayerKind.FULL_ATTENTION if window is None
            else LayerKind.SLIDING_WINDOW
            for attn, window in zip(self.layer_is_attention, self.sliding_window_per_layer)
        )

    @property
    def has_mamba(self) -> bool:
        return not all(self.layer_is_attention)

    @property
    def eos_token_id(self) -> int | None:
        """The first eos id (the one a tokenizer names); `eos_token_ids` holds every id that stops."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def mamba_intermediate_size(self) -> int:
        """Heads x head size (Granite requires it to equal mamba_expand * hidden_size)."""
        return self.mamba_shape.intermediate_size

    @property
    def mamba_conv_dim(self) -> int:
        return self.mamba_shape.conv_dim

    def attention_shape(self, layer_id: int) -> AttentionShape:
        return AttentionShape(
            hidden_size=self.hidden_size, num_heads=self.num_attention_heads,
            num_kv_heads=self.kv_heads_per_layer[layer_id], head_dim=self.head_dim,
            sliding_window=self.sliding_window_per_layer[layer_id], scale=self.attention_multiplier,
            bias=self.attention_bias,
        )

    @property
    def mamba_shape(self) -> Mamba2Shape:
        return Mamba2Shape(
            hidden_size=self.hidden_size, n_heads=self.mamba_n_heads, d_head=self.mamba_d_head,
            n_groups=self.mamba_n_groups, d_state=self.mamba_d_state, d_conv=self.mamba_d_conv,
            chunk_size=self.mamba_chunk_size, conv_bias=self.mamba_conv_bias, in_proj_bias=self.mamba_proj_bias,
            out_proj_bias=self.mamba_proj_bias, time_step_limit=self.time_step_limit, norm_eps=self.rms_norm_eps,
        )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GraniteConfig:
        return _parse(raw)


def _parse(raw: dict[str, Any]) -> GraniteConfig:
    """Defaults are transformers 5.x's `GraniteMoeGraniteConfig` defaults."""
    architectures = raw.get("architectures")
    if architectures is not None and "GraniteMoeHybridForCausalLM" not in architectures:
        raise ValueError(
            f"architectures {architectures} is not supported; supported: ['GraniteMoeHybridForCausalLM']"
        )
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act {hidden_act!r} is not supported; supported: 'silu'")
    position = raw.get("position_embedding_type")
    if position not in (None, "rope", "nope"):
        raise ValueError(f"position_embedding_type {position!r} is not supported; supported: 'rope', 'nope' or null")
    position = None if position == "nope" else position  # published Granite-4.0-H: no positional encoding

    hidden = int_field(raw, "hidden_size", 4096)
    num_layers = int_field(raw, "num_hidden_layers", 32)
    heads = int_field(raw, "num_attention_heads", 32)
    kv_heads = int_field(raw, "num_key_value_heads", heads)
    head_dim = raw.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"hidden_size ({hidden}) must be a multiple of num_attention_heads ({heads})")
        head_dim = hidden // heads

    layer_is_attention = _layer_types(raw.get("layer_types", raw.get("layers_block_type")), num_layers)
    kv_per_layer = per_layer_list(raw, "kv_heads_per_layer", num_layers)
    windows = per_layer_list(raw, "sliding_window_per_layer", num_layers)

    expand = int(raw.get("mamba_expand", 2))
    n_heads = int(raw.get("mamba_n_heads", 128))
    d_head = raw.get("mamba_d_head", "auto")
    if n_heads < 1:
        raise ValueError(f"mamba_n_heads must be >= 1, got {n_heads}")
    if d_head in (None, "auto"):
        if (expand * hidden) % n_heads:
            raise ValueError("mamba_n_heads must divide mamba_expand * hidden_size")
        d_head = expand * hidden // n_heads
    d_head = int(d_head)
    if any(not attn for attn in layer_is_attention) and d_head * n_heads != expand * hidden:
        raise ValueError(
            f"mamba_d_head * mamba_n_heads ({d_head} * {n_heads}) must equal mamba_expand * hidden_size "
            f"({expand * hidden})"
        )
    limit = time_step_limit(raw)

    return GraniteConfig(
        vocab_size=int(raw.get("vocab_size", 32000)),
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(head_dim),
        shared_intermediate_size=int(raw.get("shared_intermediate_size", 1024)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        attention_bias=bool(raw.get("attention_bias", False)),
        embedding_multiplier=float_or_one(raw, "embedding_multiplier"),
        attention_multiplier=float_or_one(raw, "attention_multiplier"),
        residual_multiplier=float_or_one(raw, "residual_multiplier"),
        logits_scaling=float_or_one(raw, "logits_scaling"),
        position_embedding_type=position,
        rope_theta=rope_theta(raw),
        **token_and_dtype_fields(raw),
        num_local_experts=int_field(raw, "num_local_experts", 8),
        num_experts_per_tok=int_field(raw, "num_experts_per_tok", 2),
        intermediate_size=int_field(raw, "intermediate_size", 11008),
        layer_is_attention=layer_is_attention,
        kv_heads_per_layer=tuple(
            (kv_heads if kv is None else int(kv)) if attn else 0 for attn, kv in zip(layer_is_attention, kv_per_layer)
        ),
        sliding_window_per_layer=tuple(
            (None if w is None else int(w)) if attn else None for attn, w in zip(layer_is_attention, windows)
        ),
        mamba_n_heads=n_heads,
        mamba_n_groups=int(raw.get("mamba_n_groups", 1)),
        mamba_d_state=int(raw.get("mamba_d_state", 256)),
        mamba_d_head=d_head,
        mamba_d_conv=int(raw.get("mamba_d_conv", 4)),
        mamba_expand=expand,
        mamba_chunk_size=int(raw.get("mamba_chunk_size", 256)),
        mamba_conv_bias=bool(raw.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(raw.get("mamba_proj_bias", False)),
        time_step_limit=limit,
    )


def _layer_types(layer_types: Any, num_layers: int) -> tuple[bool, ...]:
    """True for an attention layer. transformers defaults a missing list to all-Mamba."""
    if layer_types is None:
        return (False,) * num_layers
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ValueError(f"layer_types must be a list of num_hidden_layers ({num_layers}) entries, got {layer_types}")
    unknown = sorted({t for t in layer_types if t not in _LAYER_TYPE_NAMES}, key=str)
    if unknown:
        raise ValueError(f"unknown layer_types {unknown}; expected one of {sorted(_LAYER_TYPE_NAMES)}")
    return tuple(_LAYER_TYPE_NAMES[t] for t in layer_types)


