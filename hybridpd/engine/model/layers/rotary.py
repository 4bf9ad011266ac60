"""Rotary position embedding: tables of cos and signed sin, rotation in place."""

from __future__ import annotations

import torch


class RotaryEmbedding:
    """Default (non-scaled) RoPE over the whole head, halves rotated (`rotate_half`), as in Llama/Granite."""

    MIN_TABLE = 1024  # positions in the first table; it doubles when a step reaches past it

    def __init__(self, head_dim: int, theta: float) -> None:
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions, all below `limit` -> cos and the *signed* sin, both [T, 1, head_dim] (broadcast over
        heads): cos = (cos f, cos f), sin = (-sin f, sin f), the sign of `rotate_half` folded in (see `apply_`).

        Rows of tables computed once for positions [0, P): a step gathers its rows (two ops) instead of
        computing ten ops of trigonometry; a row is what the same formula gives for that position alone."""
        cos, sin = self._tables.get(dtype, (None, None))
        if cos is None or cos.shape[0] < limit:
            size = max(self.MIN_TABLE, 1 << (limit - 1).bit_length())
            cos, sin = self._tables[dtype] = self._table(size, dtype)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def _table(self, size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.arange(size, dtype=torch.float)[:, None] * self.inv_freq[None, :]
        sin = freqs.sin()
        cos = freqs.cos().repeat(1, 2)
        return cos.to(dtype)[:, None, :], torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :]

    @staticmethod
    def apply_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim], rotated in place: `x * cos + rotate_half(x) * sin` with rotate_half(x) =
        (-x2, x1), computed as `roll(x) * signed_sin` where roll(x) = (x2, x1). In place, x may be a strided view
        (the q and k columns of a fused projection), which then needs no copy out."""
        rolled = x.roll(x.shape[-1] // 2, dims=-1)
        return x.mul_(cos).addcmul_(rolled, sin)
