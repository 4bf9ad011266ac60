"""The shapes the shared layers are built from, whatever family declares them.

A family's config says, per layer, which mixers it has and gives each an `AttentionShape` or a `Mamba2Shape`; the
layers (layers/attention.py, layers/mamba2.py) read nothing else, so a family never has to dress itself up as
another one's config.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class AttentionShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None   # None: full attention; query i sees key j iff i - W < j <= i
    scale: float                 # the softmax scale
    bias: bool                   # on the q, k, v and o projections
    key_multiplier: float = 1.0  # keys scaled after their projection (Falcon-H1's μP)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of its KV heads ({self.num_kv_heads})"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding window must be >= 1, got {self.sliding_window}")


class MambaNorm(enum.IntEnum):
    """How the scan's output y meets the gate z before out_proj (the kernel reads the value)."""

    GATED = 0              # w * rmsnorm_per_group(y * silu(z)): Granite, Nemotron-H, Falcon-H1 with norm after gate
    GATE_ONLY = 1          # y * silu(z), no norm and no weight: Falcon-H1 with `mamba_rms_norm` false
    NORM_THEN_GATE = 2     # w * rmsnorm_per_group(y) * silu(z): Falcon-H1 with `mamba_norm_before_gate`


@dataclass(frozen=True, kw_only=True)
class Mamba2Shape:
    hidden_size: int
    n_heads: int
    d_head: int
    n_groups: int
    d_state: int
    d_conv: int
    chunk_size: int
    conv_bias: bool
    in_proj_bias: bool
    out_proj_bias: bool
    time_step_limit: tuple[float, float]
    norm_eps: float
    # Falcon-H1's μP: in_proj's outputs scaled per part (gate z, x, B, C, dt), all 1 elsewhere
    in_proj_multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    norm: MambaNorm = MambaNorm.GATED

    def __post_init__(self) -> None:
        for name in ("hidden_size", "n_heads", "d_head", "n_groups", "d_state", "d_conv", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"mamba {name} must be >= 1, got {getattr(self, name)}")
        if self.n_heads % self.n_groups:
            raise ValueError(f"mamba_n_groups ({self.n_groups}) must divide mamba_n_heads ({self.n_heads})")
        low, high = self.time_step_limit
        if not 0 <= low <= high:
            raise ValueError(f"time_step_limit must satisfy 0 <= min <= max, got {self.time_step_limit}")
        if len(self.in_proj_multipliers) != 5 or not all(math.isfinite(m) for m in self.in_proj_multipliers):
            raise ValueError(f"ssm_multipliers must be five finite numbers, got {self.in_proj_multipliers}")

    @property
    def intermediate_size(self) -> int:
        """Mamba2's inner width: heads x head size."""
        return self.n_heads * self.d_head

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: x, B and C (`intermediate + 2 * n_groups * d_state`)."""
        return self.intermediate_size + 2 * self.n_groups * self.d_state
