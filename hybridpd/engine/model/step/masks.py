"""Attention visibility: which key positions a query position sees, and the additive mask SDPA takes."""

from __future__ import annotations

import torch


def visible(queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """[len(queries), len(keys)] bool: key position k is visible from query position q (k <= q, within the
    window)."""
    seen = keys[None, :] <= queries[:, None]
    if window is not None:
        seen &= keys[None, :] > queries[:, None] - window
    return seen


def additive(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool visibility mask as an additive attention mask: 0 where visible, -inf where not."""
    return torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, float("-inf"))
