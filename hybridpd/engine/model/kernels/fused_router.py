"""A MoE router's top-k gating in one compiled pass (numba), float32 or bfloat16 (bf16_bits.py): per row the logits
(summed in float32, rounded once to the activations' dtype, as a product of that dtype is), the k largest, and a
softmax over those k only in float32, rounded to the activations' dtype: transformers' `GraniteMoeHybridTopKGating`.

As torch operations that is five calls a layer (the product, a widening, `topk`, `softmax`, a narrowing) of a few
microseconds each on a few kB: 17 us a layer at a decode step of 16 rows of the granite-moe preset, 13 at one row,
against a kernel of a few (benchmarks/README.md).

Among equal logits the lower expert comes first. torch's `topk` leaves that order to its selection algorithm; the
two can differ only where logits are equal at the k-th place, which in bfloat16 happens (its 8-bit significands) and
is a tie either way (tests/unit/engine/model/kernels/test_fused_router.py).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from hybridpd.engine.model.kernels.bf16_bits import KERNEL_DTYPES, held_array, kernel_array, narrow, widen

_I64_2D = numba.int64[:, ::1]
_F32_2D = numba.float32[:, ::1]


@numba.njit(inline="always", fastmath=True, boundscheck=False)
def route_row(row, weight, logits, chosen, ids, weights):  # pragma: no cover - compiled
    """One row's gating: `row` [H] and `weight` [E, H] in one dtype (float32, or bfloat16 bits); `logits` [E] and
    `chosen` [E] scratch; the top len(ids) experts' ids and weights (float32, of the row's dtype) into `ids` and
    `weights`."""
    experts = weight.shape[0]
    for e in range(experts):
        w = weight[e]
        total = np.float32(0.0)
        for c in range(row.shape[0]):
            total += widen(row[c]) * widen(w[c])
        logits[e] = widen(narrow(total, row))   # the product's output, in the activations' dtype
        chosen[e] = False
    for j in range(ids.shape[0]):
        best = -1
        for e in range(experts):   # strictly larger: the lower expert wins a tie
            if not chosen[e] and (best < 0 or logits[e] > logits[best]):
                best = e
        chosen[best] = True
        ids[j] = best
    top = logits[ids[0]]
    norm = np.float32(0.0)
    for j in range(ids.shape[0]):
        norm += np.float32(math.exp(logits[ids[j]] - top))
    for j in range(ids.shape[0]):
        weights[j] = widen(narrow(np.float32(math.exp(logits[ids[j]] - top)) / norm, row))


@numba.njit([numba.void(rows, rows, _I64_2D, _F32_2D) for rows in (_F32_2D, numba.uint16[:, ::1])],
            cache=True, nogil=True, fastmath=True, boundscheck=False, error_model="numpy")
def _top_k_rows(x, weight, ids, weights):  # pragma: no cover - compiled
    logits = np.empty(weight.shape[0], dtype=np.float32)
    chosen = np.empty(weight.shape[0], dtype=np.bool_)
    for t in range(x.shape[0]):
        route_row(x[t], weight, logits, chosen, ids[t], weights[t])


def top_k_route(x: torch.Tensor, weight: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `x` [T, H] routed by `weight` [E, H] (both contiguous, float32 or both bfloat16) -> (ids [T, k] int64,
    largest logit first; weights [T, k] float32, holding values of x's dtype)."""
    if x.dtype not in KERNEL_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"top_k_route: float32 or bfloat16, one dtype, got {x.dtype} and {weight.dtype}")
    if (x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or not 1 <= k <= weight.shape[0]
            or not x.is_contiguous() or not weight.is_contiguous()):
        raise ValueError(f"top_k_route: contiguous x [T, H] and weight [E, H] and 1 <= k <= E, got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}, k = {k}")
    ids = torch.empty((x.shape[0], k), dtype=torch.int64)
    weights = torch.empty((x.shape[0], k), dtype=torch.float32)
    _top_k_rows(kernel_array(x), held_array(weight), ids.numpy(), weights.numpy())
    return ids, weights
