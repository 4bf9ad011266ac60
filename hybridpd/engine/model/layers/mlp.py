"""Granite's dense MLP (`input_linear` / `output_linear`, as transformers names them)."""

from __future__ import annotations

import torch
from torch import nn

from hybridpd.engine.model.kernels.linear import linear
from hybridpd.engine.model.kernels.silu import silu_times


class DenseMLP(nn.Module):
    """Granite's `shared_mlp`: `output_linear(silu(gate) * up)` with `gate, up = input_linear(x).chunk(2)`."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype)
        self.output_linear = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One product for gate | up, the SiLU and the product in one compiled pass over its halves (silu.py). Two
        products, each output contiguous, used to pay on a prefill (torch's SiLU over the strided halves ran ~3x
        slower); with the one pass they no longer do (a 512-token float32 prefill of granite-350m, one engine,
        alternated: one product 0.956 of the two's time; the small preset's 1,024 tokens 1.02)."""
        return linear(silu_times(linear(x, self.input_linear.weight)), self.output_linear.weight)
