"""The routed experts of a few rows (a decode step) in one compiled pass (numba), float32 or bfloat16 weights.

The grouped dispatch (layers/moe.py) runs a dozen torch operations per expert that received tokens: at a decode
step of 16 rows with top-4 of 16 experts that is every expert, ~200 operations per layer of a few microseconds each
on a few rows of work. On the `granite-moe` preset at batch 16 the experts took ~15 of a ~22 ms step that way. Here
one call does, for each row and each of its k experts, `w_out[e] @ (silu(gate) * up)` with `gate | up = w_in[e] @ x`,
weighted by the router's weight and summed into the row. Sums run in another order than torch's: results agree with
the grouped dispatch to float32 rounding (tests/unit/engine/model/kernels/test_fused_moe.py).

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

from hybridpd.engine.model.kernels.bf16_bits import kernel_array, widen

RESIDENT_BYTES = 2 << 20   # a layer's expert weights up to this stay in cache from one row to the next
RESIDENT_MAX_ROWS = 256    # then: fused up to this many rows (a step of 16 decodes beside a 192-token prefill chunk)
STREAMED_MIN_ROWS = 16     # larger layers: fused up to this many rows, or while rows x top-k <= 2.5 x experts


def rows_worth_fusing(num_experts: int, top_k: int, expert_bytes: int) -> int:
    """The most rows for which the fused kernel beats the grouped dispatch on a layer whose experts' weights take
    `expert_bytes` together (the table above)."""
    if expert_bytes <= RESIDENT_BYTES:
        return RESIDENT_MAX_ROWS
    return max(STREAMED_MIN_ROWS, 5 * num_experts // (2 * top_k))


_F32_2D = numba.float32[:, ::1]
_F32_3D = numba.float32[:, :, ::1]
_U16_3D = numba.uint16[:, :, ::1]   # bfloat16 weights as their bits (bf16_bits.py)
_I64_2D = numba.int64[:, ::1]


@numba.njit([numba.void(_F32_2D, _I64_2D, _F32_2D, weights, weights, _F32_2D) for weights in (_F32_3D, _U16_3D)],
            cache=True, nogil=True, fastmath=True, boundscheck=False)
def _moe_rows(x, top_ids, top_weights, w_in, w_out, out):  # pragma: no cover - compiled
    rows, hidden = x.shape
    inter = w_out.shape[2]
    act = np.empty(inter, dtype=np.float32)
    for t in range(rows):
        xt, ot = x[t], out[t]
        for c in range(hidden):
            ot[c] = np.float32(0.0)
        for slot in range(top_ids.shape[1]):
            expert = top_ids[t, slot]
            weight = top_weights[t, slot]
            w_gate_up, w_down = w_in[expert], w_out[expert]
            for i in range(inter):
                gate_row, up_row = w_gate_up[i], w_gate_up[inter + i]
                g = np.float32(0.0)
                u = np.float32(0.0)
                for c in range(hidden):
                    g += widen(gate_row[c]) * xt[c]
                    u += widen(up_row[c]) * xt[c]
                act[i] = g / (np.float32(1.0) + np.exp(-g)) * u
            for c in range(hidden):
                down_row = w_down[c]
                y = np.float32(0.0)
                for i in range(inter):
                    y += widen(down_row[i]) * act[i]
                ot[c] += weight * y


def fused_moe_rows(x: torch.Tensor, top_ids: torch.Tensor, top_weights: torch.Tensor, w_in: torch.Tensor,
                   w_out: torch.Tensor) -> torch.Tensor:
    """sum_k top_weights[t, k] * expert_{top_ids[t, k]}(x[t]) for contiguous `x` [T, H], `w_in` [E, 2I, H] (gate
    rows, then up rows) and `w_out` [E, H, I], all float32 or all bfloat16 (read as stored, summed in float32, the
    result rounded once); `top_ids` [T, K] int64, `top_weights` [T, K]."""
    experts, hidden, inter = w_out.shape
    if (w_in.shape != (experts, 2 * inter, hidden) or x.shape[1] != hidden or top_ids.shape != top_weights.shape
            or top_ids.shape[0] != x.shape[0]):
        raise ValueError(f"fused_moe_rows: x {tuple(x.shape)}, w_in {tuple(w_in.shape)}, w_out {tuple(w_out.shape)}, "
                         f"top_ids {tuple(top_ids.shape)} do not fit")   # the kernel reads unchecked
    out = torch.empty(x.shape, dtype=torch.float32)
    _moe_rows(x.detach().float().contiguous().numpy(), top_ids.detach().contiguous().numpy(),
              top_weights.detach().float().contiguous().numpy(), kernel_array(w_in), kernel_array(w_out), out.numpy())
    return out.to(x.dtype)
