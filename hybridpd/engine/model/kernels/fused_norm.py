"""RMSNorm, and the residual add followed by RMSNorm, each in one compiled pass (numba), for float32 or bfloat16 rows.

In torch an RMSNorm is seven operations (square-sum, reshape, divide, add eps, rsqrt, two multiplies) and the
residual add before it an eighth; a decode step of the default model runs 21 norms and 20 adds, ~160 operations
that each cost their dispatch (~2 us) more than their arithmetic on 16 rows of 128. Here one call does a row's add,
sum of squares and scaling in two passes over the row. On a prefill's [4096, 128] the same fusion saves the
memory traffic of the temporaries.

    residual_rms_norm: h' = h + alpha * delta;  normed = weight * h' / sqrt(mean(h'^2) + eps)
    rms_norm:          normed = weight * h / sqrt(mean(h^2) + eps)

Sums run in float32 in another order than torch's, so results agree with the torch path (norms.py) to float32
rounding, not bit for bit (tests/unit/engine/model/kernels/test_fused_norm.py). bfloat16 rows are rounded where
torch's bfloat16 path rounds (the sum, the normalised row, its product by the weight), the rest is float32.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from hybridpd.engine.model.kernels.bf16_bits import KERNEL_DTYPES, held_array, kernel_array, narrow, widen

_F32_1D = numba.float32[::1]


def _signatures(element) -> tuple[list, list]:
    """float32 rows, or bfloat16 rows as their bits (bf16_bits.py); the weight in the rows' dtype."""
    one, two = element[::1], element[:, ::1]
    return (numba.void(two, one, numba.float32, two),
            numba.void(two, two, numba.float32, one, numba.float32, two, two))


_NORM, _RESIDUAL_NORM = ([sigs[i] for sigs in map(_signatures, (numba.float32, numba.uint16))] for i in range(2))


@numba.njit(inline="always", nogil=True, fastmath=True, boundscheck=False)
def _scaled(row, scale, weight, normed):  # pragma: no cover - compiled
    """normed = weight * (row * scale), rounded to the rows' dtype after each product as torch's bfloat16 is (the
    normalised row, then the weight's product); in float32 the plain product."""
    for c in range(row.shape[0]):
        normed[c] = narrow(widen(narrow(widen(row[c]) * scale, normed)) * widen(weight[c]), normed)


@numba.njit(_NORM, cache=True, nogil=True, fastmath=True, boundscheck=False)
def _rms_norm(h, weight, eps, out):  # pragma: no cover - compiled
    width = h.shape[1]
    for r in range(h.shape[0]):
        row = h[r]
        square = np.float32(0.0)
        for c in range(width):
            value = widen(row[c])
            square += value * value
        _scaled(row, np.float32(1.0) / np.sqrt(square / np.float32(width) + eps), weight, out[r])


@numba.njit(_RESIDUAL_NORM, cache=True, nogil=True, fastmath=True, boundscheck=False)
def _residual_rms_norm(h, delta, alpha, weight, eps, h_out, out):  # pragma: no cover - compiled
    width = h.shape[1]
    for r in range(h.shape[0]):
        row, added, summed = h[r], delta[r], h_out[r]
        square = np.float32(0.0)
        for c in range(width):
            summed[c] = narrow(widen(row[c]) + alpha * widen(added[c]), summed)
            value = widen(summed[c])
            square += value * value
        _scaled(summed, np.float32(1.0) / np.sqrt(square / np.float32(width) + eps), weight, out[r])


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, W] (contiguous; float32, or bfloat16 with a bfloat16 weight) -> its RMSNorm, a new [T, W] tensor."""
    out = torch.empty_like(h)
    _rms_norm(kernel_array(h), held_array(weight), np.float32(eps), kernel_array(out))
    return out


def residual_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, alpha: float, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """h, delta [T, W] (contiguous; float32, or bfloat16 with a bfloat16 weight) -> (h + alpha * delta, its
    RMSNorm), two new tensors."""
    summed, out = torch.empty_like(h), torch.empty_like(h)
    _residual_rms_norm(kernel_array(h), kernel_array(delta), np.float32(alpha), held_array(weight),
                       np.float32(eps), kernel_array(summed), kernel_array(out))
    return summed, out
