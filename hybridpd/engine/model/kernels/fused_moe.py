"""The routed experts of a step's rows in one compiled pass (numba), float32 or bfloat16 weights.

The grouped dispatch (layers/moe.py) runs a dozen torch operations per expert that received tokens: at a decode
step of 16 rows with top-4 of 16 experts that is every expert, ~200 operations per layer of a few microseconds each
on a few rows of work. Here one call routes each row (the router's top-k gating, fused_router.py), sorts the
(row, slot) pairs by expert, and runs each expert over its rows eight at a time: `w_out[e] @ (silu(gate) * up)` with
`gate | up = w_in[e] @ x`, each weight element read once for eight rows into eight float32 sums, weighted by the
gate's weight and summed into the rows; the last one to seven rows run as one, two, four or eight, padded with a row
of zeros (eight only where the experts stream from memory: there a read saved beats the padding's arithmetic).
Sums run in another order than torch's: results agree with the grouped dispatch to float32 rounding
(tests/unit/engine/model/kernels/test_fused_moe.py).

Where the grouped dispatch wins: MKL's products on many rows per expert beat these loops, so past some rows the
dozen operations per expert are worth their overhead (`rows_worth_fusing`). Measured one layer at a time on the Xeon
with AVX512-BF16 (benchmarks/README.md), one thread, the compiled pass over the grouped dispatch (each with its
routing) at rows 16 / 64 / 128 / 256 (`benchmarks/moe_paths.py --layer H I E K`; other runs differed by up to 0.15):

| experts per layer (H x I, E, top-k) | float32 | bfloat16 |
|---|---|---|
| 128 x 64, 16, 4 (the granite-moe preset: 1.5 MiB) | 0.16 / 0.44 / 0.69 / 1.10 | 0.14 / 0.24 / 0.52 / 0.82 |
| 256 x 128, 16, 4 (6 MiB) | 0.39 / 0.78 / 1.17 / 1.44 | 0.29 / 0.60 / 1.09 / 1.43 |
| 384 x 192, 32, 4 (27 MiB) | 0.44 / 0.78 / 0.79 / 1.59 | 0.26 / 0.41 / 0.53 / 0.74 |
| 1,536 x 512, 64, 6 (Granite-4.0-H-Tiny: 576 MiB) | 0.91 / 0.81 / 0.92 / 1.46 | 0.72 / 1.00 / 1.16 / 1.36 |

Against the kernel that ran each (row, slot) pair alone, reading the expert's weights once per pair: 0.74-0.82 of
its time on granite-moe's layer at 64-256 rows (0.63-0.68 bfloat16), 1.0-1.17 at 1-4 rows; on Tiny's 0.60 / 0.28 at
16 / 64 rows (float32; bfloat16 0.62 / 0.29).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from hybridpd.engine.model.kernels.bf16_bits import KERNEL_DTYPES, held_array, kernel_array, narrow, widen
from hybridpd.engine.model.kernels.fused_router import route_row

RESIDENT_BYTES = 2 << 20   # a layer's expert weights up to this stay in cache from one row to the next
RESIDENT_MAX_ROWS = 256    # then: fused up to this many rows (a step of 16 decodes beside a 192-token prefill chunk)
STREAMED_MAX_ROWS = 96     # larger layers: fused up to this many rows


def rows_worth_fusing(expert_bytes: int) -> int:
    """The most rows for which the fused kernel beats the grouped dispatch on a layer whose experts' weights take
    `expert_bytes` together (the table above)."""
    return RESIDENT_MAX_ROWS if expert_bytes <= RESIDENT_BYTES else STREAMED_MAX_ROWS


def _signature(element):
    rows, stacked = element[:, ::1], element[:, :, ::1]
    return numba.void(rows, rows, numba.int64, stacked, stacked, rows)


@numba.njit(inline="always", fastmath=True)
def _silu_times(gate, up):  # pragma: no cover - compiled
    return gate / (np.float32(1.0) + np.exp(-gate)) * up


@numba.njit(inline="always", fastmath=True, boundscheck=False)
def _eight_rows(w_gate_up, w_down, x0, x1, x2, x3, x4, x5, x6, x7, act, o, q):  # pragma: no cover - compiled
    """o[j] += q[j] * expert(x_j) for eight float32 rows `x0`..`x7` (their accumulators `o`, their weights `q`),
    each weight element read once for the eight; `act` [8, I] scratch."""
    inter = act.shape[1]
    for i in range(inter):
        gate_row, up_row = w_gate_up[i], w_gate_up[inter + i]
        g0 = g1 = g2 = g3 = g4 = g5 = g6 = g7 = np.float32(0.0)
        u0 = u1 = u2 = u3 = u4 = u5 = u6 = u7 = np.float32(0.0)
        for c in range(x0.shape[0]):
            wg, wu = widen(gate_row[c]), widen(up_row[c])
            g0 += wg * x0[c]
            g1 += wg * x1[c]
            g2 += wg * x2[c]
            g3 += wg * x3[c]
            g4 += wg * x4[c]
            g5 += wg * x5[c]
            g6 += wg * x6[c]
            g7 += wg * x7[c]
            u0 += wu * x0[c]
            u1 += wu * x1[c]
            u2 += wu * x2[c]
            u3 += wu * x3[c]
            u4 += wu * x4[c]
            u5 += wu * x5[c]
            u6 += wu * x6[c]
            u7 += wu * x7[c]
        act[0, i], act[1, i], act[2, i], act[3, i] = _silu_times(g0, u0), _silu_times(g1, u1), \
            _silu_times(g2, u2), _silu_times(g3, u3)
        act[4, i], act[5, i], act[6, i], act[7, i] = _silu_times(g4, u4), _silu_times(g5, u5), \
            _silu_times(g6, u6), _silu_times(g7, u7)
    a0, a1, a2, a3, a4, a5, a6, a7 = act[0], act[1], act[2], act[3], act[4], act[5], act[6], act[7]
    o0, o1, o2, o3, o4, o5, o6, o7 = o
    for c in range(w_down.shape[0]):
        down_row = w_down[c]
        y0 = y1 = y2 = y3 = y4 = y5 = y6 = y7 = np.float32(0.0)
        for i in range(inter):
            w = widen(down_row[i])
            y0 += w * a0[i]
            y1 += w * a1[i]
            y2 += w * a2[i]
            y3 += w * a3[i]
            y4 += w * a4[i]
            y5 += w * a5[i]
            y6 += w * a6[i]
            y7 += w * a7[i]
        o0[c] += q[0] * y0
        o1[c] += q[1] * y1
        o2[c] += q[2] * y2
        o3[c] += q[3] * y3
        o4[c] += q[4] * y4
        o5[c] += q[5] * y5
        o6[c] += q[6] * y6
        o7[c] += q[7] * y7


@numba.njit(inline="always", fastmath=True, boundscheck=False)
def _four_rows(w_gate_up, w_down, x0, x1, x2, x3, act, o, q):  # pragma: no cover - compiled
    """`_eight_rows` for four rows."""
    inter = act.shape[1]
    for i in range(inter):
        gate_row, up_row = w_gate_up[i], w_gate_up[inter + i]
        g0 = g1 = g2 = g3 = u0 = u1 = u2 = u3 = np.float32(0.0)
        for c in range(x0.shape[0]):
            wg, wu = widen(gate_row[c]), widen(up_row[c])
            g0 += wg * x0[c]
            g1 += wg * x1[c]
            g2 += wg * x2[c]
            g3 += wg * x3[c]
            u0 += wu * x0[c]
            u1 += wu * x1[c]
            u2 += wu * x2[c]
            u3 += wu * x3[c]
        act[0, i], act[1, i], act[2, i], act[3, i] = _silu_times(g0, u0), _silu_times(g1, u1), \
            _silu_times(g2, u2), _silu_times(g3, u3)
    a0, a1, a2, a3 = act[0], act[1], act[2], act[3]
    o0, o1, o2, o3 = o
    for c in range(w_down.shape[0]):
        down_row = w_down[c]
        y0 = y1 = y2 = y3 = np.float32(0.0)
        for i in range(inter):
            w = widen(down_row[i])
            y0 += w * a0[i]
            y1 += w * a1[i]
            y2 += w * a2[i]
            y3 += w * a3[i]
        o0[c] += q[0] * y0
        o1[c] += q[1] * y1
        o2[c] += q[2] * y2
        o3[c] += q[3] * y3


@numba.njit(inline="always", fastmath=True, boundscheck=False)
def _two_rows(w_gate_up, w_down, x0, x1, act, o0, o1, q0, q1):  # pragma: no cover - compiled
    """`_eight_rows` for two rows."""
    inter = act.shape[1]
    for i in range(inter):
        gate_row, up_row = w_gate_up[i], w_gate_up[inter + i]
        g0 = g1 = u0 = u1 = np.float32(0.0)
        for c in range(x0.shape[0]):
            wg, wu = widen(gate_row[c]), widen(up_row[c])
            g0 += wg * x0[c]
            g1 += wg * x1[c]
            u0 += wu * x0[c]
            u1 += wu * x1[c]
        act[0, i], act[1, i] = _silu_times(g0, u0), _silu_times(g1, u1)
    a0, a1 = act[0], act[1]
    for c in range(w_down.shape[0]):
        down_row = w_down[c]
        y0 = y1 = np.float32(0.0)
        for i in range(inter):
            w = widen(down_row[i])
            y0 += w * a0[i]
            y1 += w * a1[i]
        o0[c] += q0 * y0
        o1[c] += q1 * y1


@numba.njit(inline="always", fastmath=True, boundscheck=False)
def _one_row(w_gate_up, w_down, x, act, out, weight):  # pragma: no cover - compiled
    """`_eight_rows` for one row."""
    inter = act.shape[0]
    for i in range(inter):
        gate_row, up_row = w_gate_up[i], w_gate_up[inter + i]
        g = u = np.float32(0.0)
        for c in range(x.shape[0]):
            g += widen(gate_row[c]) * x[c]
            u += widen(up_row[c]) * x[c]
        act[i] = _silu_times(g, u)
    for c in range(w_down.shape[0]):
        down_row = w_down[c]
        y = np.float32(0.0)
        for i in range(inter):
            y += widen(down_row[i]) * act[i]
        out[c] += weight * y


@numba.njit(inline="always", fastmath=True, boundscheck=False)
def _expert_rows(w_gate_up, w_down, rows, weights, xw, act, acc, r, q, streamed):  # pragma: no cover - compiled
    """acc[rows[j]] += weights[j] * expert(xw[rows[j]]) for the rows that chose one expert (each row once), eight at
    a time so that each weight element read serves eight rows. The last one to seven rows run as one, two or four
    (and, where the expert's weights `streamed` from memory, eight) at a time, padded with xw's last row (zeros;
    acc's last row takes its zeros). `act` [8, I], `r` [8] and `q` [8] scratch."""
    pad, p, n = xw.shape[0] - 1, 0, rows.shape[0]
    while p < n:
        take = min(8, n - p)
        if take > 4 and not streamed and take < 8:
            take = 4   # in cache, four rows and the rest cost less than padding to eight
        width = 1 if take == 1 else 2 if take == 2 else 4 if take <= 4 else 8
        for j in range(width):
            r[j], q[j] = (rows[p + j], weights[p + j]) if j < take else (pad, np.float32(0.0))
        if width == 8:
            _eight_rows(w_gate_up, w_down, xw[r[0]], xw[r[1]], xw[r[2]], xw[r[3]], xw[r[4]], xw[r[5]], xw[r[6]],
                        xw[r[7]], act, (acc[r[0]], acc[r[1]], acc[r[2]], acc[r[3]], acc[r[4]], acc[r[5]],
                                        acc[r[6]], acc[r[7]]), q)
        elif width == 4:
            _four_rows(w_gate_up, w_down, xw[r[0]], xw[r[1]], xw[r[2]], xw[r[3]], act,
                       (acc[r[0]], acc[r[1]], acc[r[2]], acc[r[3]]), q)
        elif width == 2:
            _two_rows(w_gate_up, w_down, xw[r[0]], xw[r[1]], act, acc[r[0]], acc[r[1]], q[0], q[1])
        else:
            _one_row(w_gate_up, w_down, xw[r[0]], act[0], acc[r[0]], q[0])
        p += take


@numba.njit([_signature(element) for element in (numba.float32, numba.uint16)], cache=True, nogil=True,
            fastmath=True, boundscheck=False)
def _routed_moe_rows(x, router, k, w_in, w_out, out):  # pragma: no cover - compiled
    rows, hidden = x.shape
    experts, inter = router.shape[0], w_out.shape[2]
    ids, weights = np.empty((rows, k), np.int64), np.empty((rows, k), np.float32)
    logits, chosen = np.empty(experts, np.float32), np.empty(experts, np.bool_)
    for t in range(rows):
        route_row(x[t], router, logits, chosen, ids[t], weights[t])
    # The (row, slot) pairs grouped by expert: a counting sort.
    starts = np.zeros(experts + 1, np.int64)
    for t in range(rows):
        for s in range(k):
            starts[ids[t, s] + 1] += 1
    for e in range(experts):
        starts[e + 1] += starts[e]
    fill = starts[:experts].copy()
    pair_rows, pair_weights = np.empty(rows * k, np.int64), np.empty(rows * k, np.float32)
    for t in range(rows):
        for s in range(k):
            e = ids[t, s]
            pair_rows[fill[e]], pair_weights[fill[e]] = t, weights[t, s]
            fill[e] += 1
    xw, acc = np.zeros((rows + 1, hidden), np.float32), np.zeros((rows + 1, hidden), np.float32)   # + the pad
    for t in range(rows):
        for c in range(hidden):
            xw[t, c] = widen(x[t, c])
    act, r, q = np.empty((8, inter), np.float32), np.empty(8, np.int64), np.empty(8, np.float32)
    streamed = (w_in.size + w_out.size) * w_in.itemsize > RESIDENT_BYTES
    for e in range(experts):
        span = slice(starts[e], starts[e + 1])
        _expert_rows(w_in[e], w_out[e], pair_rows[span], pair_weights[span], xw, act, acc, r, q, streamed)
    for t in range(rows):
        for c in range(hidden):
            out[t, c] = narrow(acc[t, c], out)


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
