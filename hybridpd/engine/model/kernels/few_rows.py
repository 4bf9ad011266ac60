"""`x @ weight.T (+ bias)` for a few rows (a decode step's batch) in one compiled pass (numba), float32 (or a
bfloat16 weight: `few_rows_linear_bf16`); one row by either dtype's weight in a loop of its own (`one_row_linear`).

A decode step multiplies a handful of rows by every projection's weight, and its time is those products: on the
`granite-350m` preset at batch 8, 95% of the step. There MKL's kernels are at their worst: on this project's 2-core
AMD EPYC guest (AVX2), one thread, the preset's four projection shapes (768 -> 3,376 / 4,096, 1,536 / 2,048 -> 768)
at 2, 4, 8 and 16 rows took 7.3, 8.9, 9.5 and 13.5 ms with MKL against 3.7, 4.2, 5.9 and 8.5 ms here (at 1 row
both 2.8 ms; from 32 rows MKL is ahead). A float32 weight is taken four output columns at a time: for each
group of four rows, the sixteen dot products of four rows by the four columns' contiguous weight rows, each
accumulated in vector registers; a bfloat16 weight one column at a time (four dot products). On the Xeon with
AVX512-BF16 (benchmarks/README.md), where Intel's MKL reads a few rows well, the four-column loop took
granite-350m's float32 decode steps to 0.73 / 0.75 of the one-column loop's time at 4 / 8 rows, and to 0.84 of
MKL's at 4, 6 and 8 rows.

Every row goes through the same four-row loop (a last group short of four repeats its last row), and a column through
the same loop whatever the rows, so a row's result does not depend on the rows beside it or on its place among them.
The sums run in another order than MKL's: results agree with `F.linear` to float32 rounding
(tests/unit/engine/model/kernels/test_few_rows.py), as the oneDNN path of linear.py does.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from hybridpd.engine.dtype_choice import this_cpus_flags
from hybridpd.engine.model.kernels.bf16_bits import held_array, kernel_array, narrow, widen

_F32_1D = numba.float32[::1]
_F32_2D = numba.float32[:, ::1]
_U16_1D = numba.uint16[::1]
_U16_2D = numba.uint16[:, ::1]


@numba.njit(inline="always", fastmath=True, boundscheck=False)
def _rows_by_four_columns(x, weight, bias, has_bias, out):  # pragma: no cover - compiled
    """float32 rows `x` by a float32 `weight` into `out`: four output columns at a time (`_four_columns`), the last
    columns short of four one at a time (`_one_column`)."""
    columns = weight.shape[0]
    whole = columns - columns % 4
    for j in range(0, whole, 4):
        _four_columns(x, weight, bias, has_bias, out, j)
    for j in range(whole, columns):
        _one_column(x, weight, bias, has_bias, out, j)


@numba.njit(inline="always", fastmath=True, boundscheck=False)
def _rows_by_column(x, weight, bias, has_bias, out):  # pragma: no cover - compiled
    """float32 rows `x` by a `weight` of float32 or bfloat16 bits (each element widened where it is read, so a
    bfloat16 weight streams half the bytes and its products run in float32, in 0.7-0.8 of the time a float32 scratch
    copy of each row took) into float32 sums `out`, one column at a time: on bfloat16 weights the four-column loop
    took 1.6-2x as long (small-vllm's 128-wide weights, in cache), and with AVX2's sixteen vector registers its
    sixteen sums would not fit beside the loads."""
    for j in range(weight.shape[0]):
        _one_column(x, weight, bias, has_bias, out, j)


@numba.njit(inline="always", fastmath=True, boundscheck=False)
def _four_columns(x, weight, bias, has_bias, out, j):  # pragma: no cover - compiled
    """Columns j..j+3 of float32 `weight`, four rows at a time: sixteen sums side by side, each weight element loaded
    once for four rows and each row element once for four columns (half the loads of a multiply-add that the
    one-column loop makes), in sixteen independent chains of multiply-adds (four there)."""
    rows, width = x.shape
    last = rows - 1
    w0, w1, w2, w3 = weight[j], weight[j + 1], weight[j + 2], weight[j + 3]
    for m in range(0, rows, 4):
        x0, x1, x2, x3 = x[m], x[min(m + 1, last)], x[min(m + 2, last)], x[min(m + 3, last)]
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        a3 = np.float32(0.0)
        b0 = np.float32(0.0)
        b1 = np.float32(0.0)
        b2 = np.float32(0.0)
        b3 = np.float32(0.0)
        c0 = np.float32(0.0)
        c1 = np.float32(0.0)
        c2 = np.float32(0.0)
        c3 = np.float32(0.0)
        d0 = np.float32(0.0)
        d1 = np.float32(0.0)
        d2 = np.float32(0.0)
        d3 = np.float32(0.0)
        for k in range(width):
            u0, u1, u2, u3 = w0[k], w1[k], w2[k], w3[k]
            p = x0[k]
            a0 += p * u0
            a1 += p * u1
            a2 += p * u2
            a3 += p * u3
            p = x1[k]
            b0 += p * u0
            b1 += p * u1
            b2 += p * u2
            b3 += p * u3
            p = x2[k]
            c0 += p * u0
            c1 += p * u1
            c2 += p * u2
            c3 += p * u3
            p = x3[k]
            d0 += p * u0
            d1 += p * u1
            d2 += p * u2
            d3 += p * u3
        _store_four(out, m, j, a0, a1, a2, a3, bias, has_bias)
        if m + 1 <= last:
            _store_four(out, m + 1, j, b0, b1, b2, b3, bias, has_bias)
        if m + 2 <= last:
            _store_four(out, m + 2, j, c0, c1, c2, c3, bias, has_bias)
        if m + 3 <= last:
            _store_four(out, m + 3, j, d0, d1, d2, d3, bias, has_bias)


@numba.njit(inline="always", fastmath=True, boundscheck=False)
def _store_four(out, m, j, s0, s1, s2, s3, bias, has_bias):  # pragma: no cover - compiled
    out[m, j] = s0 + _bias_at(bias, has_bias, j)
    out[m, j + 1] = s1 + _bias_at(bias, has_bias, j + 1)
    out[m, j + 2] = s2 + _bias_at(bias, has_bias, j + 2)
    out[m, j + 3] = s3 + _bias_at(bias, has_bias, j + 3)


@numba.njit(inline="always", fastmath=True, boundscheck=False)
def _bias_at(bias, has_bias, j):  # pragma: no cover - compiled
    """What column j's sums start from: its bias, or zero."""
    return np.float32(bias[j]) if has_bias else np.float32(0.0)


@numba.njit(inline="always", fastmath=True, boundscheck=False)
def _one_column(x, weight, bias, has_bias, out, j):  # pragma: no cover - compiled
    """Column j, four rows at a time."""
    rows, width = x.shape
    last = rows - 1
    w = weight[j]
    start = _bias_at(bias, has_bias, j)
    for m in range(0, rows, 4):
        x0, x1, x2, x3 = x[m], x[min(m + 1, last)], x[min(m + 2, last)], x[min(m + 3, last)]
        s0 = np.float32(0.0)
        s1 = np.float32(0.0)
        s2 = np.float32(0.0)
        s3 = np.float32(0.0)
        for k in range(width):
            wk = widen(w[k])
            s0 += x0[k] * wk
            s1 += x1[k] * wk
            s2 += x2[k] * wk
            s3 += x3[k] * wk
        out[m, j] = s0 + start
        if m + 1 <= last:
            out[m + 1, j] = s1 + start
        if m + 2 <= last:
            out[m + 2, j] = s2 + start
        if m + 3 <= last:
            out[m + 3, j] = s3 + start


@numba.njit(numba.void(_F32_2D, _F32_2D, _F32_1D, numba.boolean, _F32_2D), cache=True, nogil=True, fastmath=True,
            boundscheck=False)
def _few_rows(x, weight, bias, has_bias, out):  # pragma: no cover - compiled
    """float32 rows by a float32 weight into float32 results, four columns at a time."""
    _rows_by_four_columns(x, weight, bias, has_bias, out)


@numba.njit([numba.void(_F32_2D, weights, _F32_1D, numba.boolean, _F32_2D) for weights in (_F32_2D, _U16_2D)],
            cache=True, nogil=True, fastmath=True, boundscheck=False)
def _few_rows_by_column(x, weight, bias, has_bias, out):  # pragma: no cover - compiled
    """float32 rows by a float32 or bfloat16 weight into float32 results, one column at a time."""
    _rows_by_column(x, weight, bias, has_bias, out)


@numba.njit(numba.void(_U16_2D, _U16_2D, _F32_1D, numba.boolean, _U16_2D), cache=True, nogil=True, fastmath=True,
            boundscheck=False)
def _few_rows_bf16(x, weight, bias, has_bias, out):  # pragma: no cover - compiled
    """bfloat16 rows (bits) by a bfloat16 weight into bfloat16 results: the rows widened once into a float32
    scratch here, where the caller used to copy them to float32 and the float32 results back (two torch copies and
    their allocations: ~5 of the ~18 us of an 8-row product by a 580 x 128 weight)."""
    rows = np.empty(x.shape, dtype=np.float32)
    for m in range(x.shape[0]):
        for k in range(x.shape[1]):
            rows[m, k] = widen(x[m, k])
    sums = np.empty(out.shape, dtype=np.float32)
    _rows_by_column(rows, weight, bias, has_bias, sums)
    for m in range(out.shape[0]):   # rounded in a pass of its own, which vectorises (in the loop it cost ~8%)
        for j in range(out.shape[1]):
            out[m, j] = narrow(sums[m, j], out)


@numba.njit([numba.void(array, matrix, _F32_1D, numba.boolean, array)
             for array, matrix in ((_F32_1D, _F32_2D), (_U16_1D, _U16_2D))],
            cache=True, nogil=True, fastmath=True, boundscheck=False)
def _one_row(x, weight, bias, has_bias, out):  # pragma: no cover - compiled
    """One row: a dot product per weight row, the weight read once in order, the row and the result in the
    weight's dtype (bfloat16 widened where read, each result rounded once where stored). Without the four-row loop's
    three copies of the row it reads the weight faster (EPYC-AVX512-BF16, granite-350m's shapes past the L3: 34-35
    against 28 GB/s in bfloat16, 35-39 against 27 in float32; oneDNN's packed product 32-35)."""
    for j in range(weight.shape[0]):
        w = weight[j]
        s = np.float32(0.0)
        for k in range(x.shape[0]):
            s += widen(x[k]) * widen(w[k])
        out[j] = narrow(s + _bias_at(bias, has_bias, j), out)


_NO_BIAS = np.zeros(0, dtype=np.float32)
# A float32 weight four columns at a time where AVX-512's 32 vector registers hold the sixteen sums and the loads;
# with AVX2's 16 (unmeasured there) one column at a time, as before the four-column loop.
_FOUR_COLUMNS = "avx512f" in this_cpus_flags()


def _bias_array(bias: torch.Tensor | None) -> np.ndarray:
    """The kernels' bias: float32, contiguous (an empty array for none; `has_bias` tells them apart)."""
    return _NO_BIAS if bias is None else bias.detach().float().contiguous().numpy()


def _check_shapes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> None:
    if x.shape[1] != weight.shape[1] or (bias is not None and bias.shape != (weight.shape[0],)):
        raise ValueError(f"{kernel}: x {tuple(x.shape)}, weight {tuple(weight.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)} do not fit")   # the kernel reads unchecked


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a contiguous float32 [T, K] `x` and [N, K] `weight` (a new [T, N] tensor)."""
    _check_shapes(x, weight, bias, "few_rows_linear")
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32)
    kernel = _few_rows if _FOUR_COLUMNS else _few_rows_by_column
    kernel(x.detach().numpy(), weight.detach().numpy(), _bias_array(bias), bias is not None, out.numpy())
    return out


def few_rows_linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a [T, K] `x` and a contiguous [N, K] bfloat16 `weight`, summed in float32 and
    rounded once to bfloat16 at the end (a new [T, N] bfloat16 tensor). The weight is read as it is stored, two bytes
    an element: a decode step's time is that read."""
    _check_shapes(x, weight, bias, "few_rows_linear_bf16")
    if x.dtype == torch.bfloat16 and x.is_contiguous():
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16)
        _few_rows_bf16(kernel_array(x), held_array(weight), _bias_array(bias), bias is not None, kernel_array(out))
        return out
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32)
    _few_rows_by_column(x.detach().float().contiguous().numpy(), held_array(weight), _bias_array(bias),
                        bias is not None, out.numpy())
    return out.to(torch.bfloat16)


def one_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for one row `x` ([1, K]) by a contiguous [N, K] weight of its dtype, float32 or
    bfloat16 (read as stored), summed in float32 and rounded once to that dtype. Its sums run in another order than
    the four-row loop's: a row's result here may differ from the same row's among others in the last bit."""
    _check_shapes(x, weight, bias, "one_row_linear")
    if x.shape[0] != 1:
        raise ValueError(f"one_row_linear: x {tuple(x.shape)} is not one row")
    if x.dtype != weight.dtype:
        raise ValueError(f"one_row_linear: x is {x.dtype}, the weight {weight.dtype}")
    out = torch.empty((1, weight.shape[0]), dtype=x.dtype)
    _one_row(kernel_array(x.contiguous())[0], held_array(weight), _bias_array(bias), bias is not None,
             kernel_array(out)[0])
    return out
