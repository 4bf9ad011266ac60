"""`FalconH1Config`: a `FalconH1ForCausalLM` config.json read the way transformers 5.x reads it.

Every layer holds attention and Mamba2 side by side (both read the same normed input; their outputs are added to the
residual), then an MLP. Falcon-H1's μP multipliers are read as published: the embedding, the head, each mixer's
input and output, the keys, Mamba's in_proj parts (`ssm_multipliers`: z, x, B, C, dt) and the MLP's gate and output
(`mlp_multipliers`). Mamba's output meets its gate through a gated RMSNorm (`mamba_rms_norm`, before or after the
gate: `mamba_norm_before_gate`) or alone. Attention uses RoPE over the whole head and the softmax scale
head_dim^-0.5. Defaults are transformers' `FalconH1Config` defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridpd.engine.model.config_fields import (
    float_or_one, int_field, rope_theta, time_step_limit, token_and_dtype_fields,
)
from hybridpd.engine.model.shapes import AttentionShape, Mamba2Shape, MambaNorm


@dataclass(frozen=True, kw_only=True)
class FalconH1Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]   # every listed id stops generation
    checkpoint_dtype: str
    mlp_bias: bool
    attention: AttentionShape        # every layer's
    mamba: Mamba2Shape               # every layer's
    embedding_multiplier: float
    lm_head_multiplier: float
    attention_in_multiplier: float
    attention_out_multiplier: float
    ssm_in_multiplier: float
    ssm_out_multiplier: float
    mlp_multipliers: tuple[float, float]   # the gate's input, the output

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.attention.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.attention.head_dim}")

    @property
    def has_mamba(self) -> bool:
        return True

    @property
    def mamba_chunk_size(self) -> int:
        return self.mamba.chunk_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> FalconH1Config:
        return parse_falcon_h1(raw)


def _multipliers(raw: dict[str, Any], key: str, count: int) -> tuple[float, ...]:
    values = raw.get(key)
    if values is None:
        return (1.0,) * count
    if (not isinstance(values, list) or len(values) != count
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)):
        raise ValueError(f"{key} must be a list of {count} numbers, got {values!r}")
    return tuple(float(v) for v in values)


def _norm(raw: dict[str, Any]) -> MambaNorm:
    if not raw.get("mamba_rms_norm", False):
        return MambaNorm.GATE_ONLY
    return MambaNorm.NORM_THEN_GATE if raw.get("mamba_norm_before_gate", True) else MambaNorm.GATED


def parse_falcon_h1(raw: dict[str, Any]) -> FalconH1Config:
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act {hidden_act!r} is not supported; supported: 'silu'")
    hidden = int_field(raw, "hidden_size", 4096)
    heads = int_field(raw, "num_attention_heads", 32)
    head_dim = raw.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"hidden_size ({hidden}) must be a multiple of num_attention_heads ({heads})")
        head_dim = hidden // heads
    d_ssm = raw.get("mamba_d_ssm", 1024)
    d_ssm = int_field(raw, "mamba_expand", 2) * hidden if d_ssm is None else int_field(raw, "mamba_d_ssm", 1024)
    n_heads = int_field(raw, "mamba_n_heads", 128)
    d_head = raw.get("mamba_d_head", "auto")
    if d_head in (None, "auto"):
        if d_ssm % n_heads:
            raise ValueError(f"mamba_n_heads ({n_heads}) must divide mamba_d_ssm ({d_ssm})")
        d_head = d_ssm // n_heads
    d_head = int_field({"mamba_d_head": d_head}, "mamba_d_head", 0)
    if d_head * n_heads != d_ssm:
        raise ValueError(f"mamba_d_head * mamba_n_heads ({d_head} * {n_heads}) must equal mamba_d_ssm ({d_ssm})")
    eps = float(raw.get("rms_norm_eps", 1e-5))
    attention_bias = bool(raw.get("attention_bias", False))
    attention = AttentionShape(
        hidden_size=hidden, num_heads=heads, num_kv_heads=int_field(raw, "num_key_value_heads", 8)
        if raw.get("num_key_value_heads", 8) is not None else heads,
        head_dim=int_field({"head_dim": head_dim}, "head_dim", 0), sliding_window=None,
        scale=int(head_dim) ** -0.5, bias=attention_bias, key_multiplier=float_or_one(raw, "key_multiplier"),
    )
    mamba = Mamba2Shape(
        hidden_size=hidden, n_heads=n_heads, d_head=d_head, n_groups=int_field(raw, "mamba_n_groups", 1),
        d_state=int_field(raw, "mamba_d_state", 256), d_conv=int_field(raw, "mamba_d_conv", 4),
        chunk_size=int_field(raw, "mamba_chunk_size", 256), conv_bias=bool(raw.get("mamba_conv_bias", True)),
        in_proj_bias=bool(raw.get("mamba_proj_bias", False)), out_proj_bias=bool(raw.get("projectors_bias", False)),
        time_step_limit=time_step_limit(raw), norm_eps=eps,
        in_proj_multipliers=_multipliers(raw, "ssm_multipliers", 5),  # type: ignore[arg-type]
        norm=_norm(raw),
    )
    return FalconH1Config(
        vocab_size=int_field(raw, "vocab_size", 128000),
        hidden_size=hidden,
        num_hidden_layers=int_field(raw, "num_hidden_layers", 32),
        intermediate_size=int_field(raw, "intermediate_size", 14336),
        max_position_embeddings=int_field(raw, "max_position_embeddings", 8192),
        rms_norm_eps=eps,
        rope_theta=rope_theta(raw),
        **token_and_dtype_fields(raw),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        attention=attention,
        mamba=mamba,
        embedding_multiplier=float_or_one(raw, "embedding_multiplier"),
        lm_head_multiplier=float_or_one(raw, "lm_head_multiplier"),
        attention_in_multiplier=float_or_one(raw, "attention_in_multiplier"),
        attention_out_multiplier=float_or_one(raw, "attention_out_multiplier"),
        ssm_in_multiplier=float_or_one(raw, "ssm_in_multiplier"),
        ssm_out_multiplier=float_or_one(raw, "ssm_out_multiplier"),
        mlp_multipliers=_multipliers(raw, "mlp_multipliers", 2),  # type: ignore[arg-type]
    )
