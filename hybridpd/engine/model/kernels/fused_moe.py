"""The routed experts of a few rows (a decode step) in one compiled pass (numba), float32 or bfloat16 weights.

The grouped dispatch (layers/moe.py) runs a dozen torch operations per expert that received tokens: at a decode
step of 16 rows with top-4 of 16 experts that is every expert, ~200 operations per layer of a few microseconds each
on a few rows of work. On the `granite-moe` preset at batch 16 the experts took ~15 of a ~22 ms step that way. Here
one call routes each row (the router's top-k gating, fused_router.py) and does, for each of its k experts,
`w_out[e] @ (silu(gate) * up)` with `gate | up = w_in[e] @ x`, weighted by the gate's weight and summed into the row.
Sums run in another order than torch's: results agree with the grouped dispatch to float32 rounding
(tests/unit/engine/model/kernels/test_fused_moe.py).

The kernel reads an expert's weights once per (row, slot) that chose it; the grouped dispatch once per expert, at a
few operations' overhead each. Which wins depends on whether the layer's experts stay in cache (`rows_worth_fusing`,
measured one layer at a time on the 2-core EPYC guest, float32, one thread):

| experts per layer (H x I, E, top-k) | weights | fused over grouped at rows 16 / 64 / 128 / 256 |
|---|---|---|
| 128 x 64, 16, 4 (the granite-moe preset) | 1.5 MiB | 0.14 / 0.39 / 0.62 / 0.96 (1.12 at 512) |
| 256 x 128, 16, 4 | 6 MiB | 0.18 / 0.62 / 0.97 / 1.20 |
| 384 x 192, 32, 4 | 27 MiB | 0.40 / 1.10 / 1.80 / 2.89 |
| 1,536 x 512, 64, 6 (Granite-4.0-H-Tiny) | 604 MiB | 0.75 / 1.57 (1.06 at 32) |
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from hybridpd.engine.model.kernels.bf16_bits import KERNEL_DTYPES, held_array, kernel_array, narrow, widen
from hybridpd.engine.model.kernels.fused_router import route_row

RESIDENT_BYTES = 2 << 20   # a layer's expert weights up to this stay in cache from one row to the next
RESIDENT_MAX_ROWS = 256    # then: fused up to this many rows (a step of 16 decodes beside a 192-token prefill chunk)
STREAMED_MIN_ROWS = 16     # larger layers: fused up to this many rows, or while rows x top-k <= 2.5 x experts


def rows_worth_fusing(num_experts: int, top_k: int, expert_bytes: int) -> int:
    """The most rows for which the fused kernel beats the grouped dispatch on a layer whose experts' weights take
    `expert_bytes` together (the table above)."""
    if expert_bytes <= RESIDENT_BYTES:
        return RESIDENT_MAX_ROWS
    return max(STREAMED_MIN_ROWS, 5 * num_experts // (2 * top_k))


def _signature(element):
    rows, stacked = element[:, ::1], element[:, :, ::1]
    return numba.void(rows, rows, numba.int64, stacked, stacked, rows)


@numba.njit(inline="always", fastmath=True, boundscheck=False)
def _experts_row(row, ids, weights, w_in, w_out, xt, act, ot, result):  # pragma: no cover - compiled
    """One row's chosen experts, weighted and summed, rounded once into `result`; `xt`, `act`, `ot` scratch."""
    hidden, inter = xt.shape[0], act.shape[0]
    for c in range(hidden):
        xt[c] = widen(row[c])
        ot[c] = np.float32(0.0)
    for slot in range(ids.shape[0]):
        w_gate_up, w_down = w_in[ids[slot]], w_out[ids[slot]]
        for i in range(inter):
            gate_row, up_row = w_gate_up[i], w_gate_up[inter + i]
            g = np.float32(0.0)
            u = np.float32(0.0)
            for c in range(hidden):
                g += widen(gate_row[c]) * xt[c]
                u += widen(up_row[c]) * xt[c]
            act[i] = g / (np.float32(1.0) + np.exp(-g)) * u
        weight = weights[slot]
        for c in range(hidden):
            down_row = w_down[c]
            y = np.float32(0.0)
            for i in range(inter):
                y += widen(down_row[i]) * act[i]
            ot[c] += weight * y
    for c in range(hidden):
        result[c] = narrow(ot[c], result)


@numba.njit([_signature(element) for element in (numba.float32, numba.uint16)], cache=True, nogil=True,
            fastmath=True, boundscheck=False)
def _routed_moe_rows(x, router, k, w_in, w_out, out):  # pragma: no cover - compiled
    hidden, inter, experts = x.shape[1], w_out.shape[2], router.shape[0]
    xt, ot, act = np.empty(hidden, np.float32), np.empty(hidden, np.float32), np.empty(inter, np.float32)
    logits, chosen = np.empty(experts, np.float32), np.empty(experts, np.bool_)
    ids, weights = np.empty(k, np.int64), np.empty(k, np.float32)
    for t in range(x.shape[0]):
        route_row(x[t], router, logits, chosen, ids, weights)
        _experts_row(x[t], ids, weights, w_in, w_out, xt, act, ot, out[t])


def routed_moe_rows(x: torch.Tensor, router: torch.Tensor, k: int, w_in: torch.Tensor,
                    w_out: torch.Tensor) -> torch.Tensor:
    """sum_k weight_k(x[t]) * expert_{id_k(x[t])}(x[t]) for each row of a contiguous `x` [T, H], its top-`k` experts
    and their weights chosen in the same pass by the router's weight [E, H] (fused_router.py's gating: the router
    alone was five torch operations); `w_in` [E, 2I, H] (gate rows, then up rows) and `w_out` [E, H, I]. All float32
    or all bfloat16: read as stored, summed in float32, the result rounded once to x's dtype."""
    experts, hidden, inter = w_out.shape
    if (w_in.shape != (experts, 2 * inter, hidden) or x.dim() != 2 or x.shape[1] != hidden
            or router.shape != (experts, hidden) or not 1 <= k <= experts):
        raise ValueError(f"routed_moe_rows: x {tuple(x.shape)}, router {tuple(router.shape)}, w_in "
                         f"{tuple(w_in.shape)}, w_out {tuple(w_out.shape)}, top {k} do not fit")
    if not x.dtype == router.dtype == w_in.dtype == w_out.dtype or x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"routed_moe_rows: float32 or bfloat16, one dtype, got {x.dtype}, {router.dtype}, "
                         f"{w_in.dtype}, {w_out.dtype}")
    out = torch.empty(x.shape, dtype=x.dtype)
    _routed_moe_rows(kernel_array(x.contiguous()), held_array(router.contiguous()), k, held_array(w_in),
                     held_array(w_out), kernel_array(out))
    return out
