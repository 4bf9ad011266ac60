"""The small layers: RMSNorm, Mamba2's gated RMSNorm, the dense MLP, rotary position embedding.

Module and parameter names are transformers' (`weight`, `input_linear`, `output_linear`), so a checkpoint's
state dict loads as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridpd.engine.model.fused_norm import residual_rms_norm, rms_norm
from hybridpd.engine.model.linear import linear


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

        Float32 rows go through the compiled kernel (fused_norm.py: one call instead of seven operations). Other
        dtypes: spelled out rather than `F.rms_norm`, whose CPU kernel is ~8x slower on a prefill's [4096, 128]; the
        mean square as a dot product divided by the size, which is what `mean` computes (the same bits), in
        fewer dispatches (a decode step normalises 21 times)."""
        if _fusable(x, self.weight):
            return rms_norm(x, self.weight, self.eps)
        h = x.float()
        mean_square = torch.linalg.vecdot(h, h).unsqueeze_(-1).div_(self._size)
        h = h * mean_square.add_(self._eps).rsqrt_()
        if x.dtype == torch.float32:
            return h.mul_(self.weight)
        return self.weight * h.to(x.dtype)


    def add_and_norm(self, h: torch.Tensor, delta: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + alpha * delta, its norm): the residual add and the norm after it, in one compiled pass for float32
        rows."""
        if _fusable(h, self.weight) and _fusable(delta, self.weight):
            return residual_rms_norm(h, delta, alpha, self.weight, self.eps)
        h = torch.add(h, delta, alpha=alpha)
        return h, self.forward(h)


def _fusable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and weight.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous()


class GatedRMSNorm(nn.Module):
    """`weight * rmsnorm_per_group(y * silu(gate))`, the norm computed over groups of `group_size` channels."""

    def __init__(self, hidden_size: int, group_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.group_size = group_size
        self.eps = eps
        self._eps = torch.tensor(eps)  # see RMSNorm
        self._size = torch.tensor(float(group_size))

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The normalisation in float32; the weight applied in float32 for a float32 `y`, else in y's dtype.

        Spelled out (a silu, then in-place ops on the one new tensor) rather than `F.rms_norm`, whose CPU
        kernel is ~4x slower on a prefill's [4096, 256]; see RMSNorm."""
        h = F.silu(gate.float()).mul_(y)
        grouped = h.view(*h.shape[:-1], -1, self.group_size)
        mean_square = torch.linalg.vecdot(grouped, grouped).unsqueeze_(-1).div_(self._size)
        grouped.mul_(mean_square.add_(self._eps).rsqrt_())
        if y.dtype == torch.float32:
            return h.mul_(self.weight)
        return self.weight * h.to(y.dtype)


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
        if x.shape[0] >= self.SEPARATE_FROM_ROWS:
            half = weight.shape[0] // 2
            gate, up = linear(x, weight[:half]), linear(x, weight[half:])
        else:
            gate, up = F.linear(x, weight).chunk(2, dim=-1)
        return linear(F.silu(gate, inplace=True).mul_(up), self.output_linear.weight)  # in place: the projection is ours


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
