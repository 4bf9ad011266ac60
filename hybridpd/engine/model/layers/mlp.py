"""Granite's dense MLP (`input_linear` / `output_linear`, as transformers names them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridpd.engine.model.kernels.linear import halves_pay, linear


class DenseMLP(nn.Module):
    """Granite's `shared_mlp`: `output_linear(silu(gate) * up)` with `gate, up = input_linear(x).chunk(2)`."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype)
        self.output_linear = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)

    # From this many rows (a prefill) gate and up come from two products: each output is contiguous, which makes the
    # SiLU and the product ~3x faster than over the strided halves of one [rows, 2 I] output; a decode step's few
    # rows take the one fused product (there the number of calls is what counts).
    SEPARATE_FROM_ROWS = 256

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.input_linear.weight
        if x.shape[0] >= self.SEPARATE_FROM_ROWS and halves_pay(x, weight):
            half = weight.shape[0] // 2
            gate, up = linear(x, weight[:half]), linear(x, weight[half:])
        else:
            gate, up = linear(x, weight).chunk(2, dim=-1)
        return linear(F.silu(gate, inplace=True).mul_(up), self.output_linear.weight)  # in place: the projection is ours
