"""RMSNorm (parameter name `weight`, as transformers writes it) and the residual add before it, compiled for float32
and bfloat16 rows."""

from __future__ import annotations

import torch
from torch import nn

from hybridpd.engine.model.kernels.bf16_bits import KERNEL_DTYPES
from hybridpd.engine.model.kernels.fused_norm import residual_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps
        # Plain tensor attributes, not buffers: read without nn.Module.__getattr__, and as tensors they spare each
        # call the wrapping of a Python scalar into a tensor (~2 us per op on a decode step).
        self._eps = torch.tensor(eps)
        self._size = torch.tensor(float(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`weight * (x / rms(x))`, the normalisation in float32 and the weight applied in x's dtype.

        Float32 and bfloat16 rows go through the compiled kernel (fused_norm.py: one call instead of seven
        operations). Other dtypes: spelled out rather than `F.rms_norm`, whose CPU kernel is ~8x slower on a
        prefill's [4096, 128]; the mean square as a dot product divided by the size, which is what `mean` computes
        (the same bits), in fewer dispatches (a decode step normalises 21 times)."""
        if _fusable(x, self.weight):
            return rms_norm(x, self.weight, self.eps)
        h = x.float()
        mean_square = torch.linalg.vecdot(h, h).unsqueeze_(-1).div_(self._size)
        h = h * mean_square.add_(self._eps).rsqrt_()
        if x.dtype == torch.float32:
            return h.mul_(self.weight)
        return self.weight * h.to(x.dtype)

    def add_and_norm(self, h: torch.Tensor, delta: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + alpha * delta, its norm): the residual add and the norm after it, in one compiled pass for float32 or
        bfloat16 rows."""
        if _fusable(h, self.weight) and _fusable(delta, self.weight):
            return residual_rms_norm(h, delta, alpha, self.weight, self.eps)
        h = torch.add(h, delta, alpha=alpha)
        return h, self.forward(h)


def _fusable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dtype in KERNEL_DTYPES and weight.dtype == x.dtype and x.dim() == 2 and x.is_contiguous()
