"""SiLU inside compiled loops (numba), in float32, where LLVM can vectorise it; an MLP's `silu(gate) * up` as one
such loop (`silu_times`), and every expert's of a MoE layer at once, weighted by each row's routing weights
(`silu_times_weighted`).

numba compiles `math.exp` to a call of libm's `expf`, one element at a time, which made the SiLUs half of a one-pass
Mamba kernel's time; so the kernels used to leave them to torch, one more pass over each [T, C] array. `exp32` is
Cephes' `expf` written out (a rounding to the nearest power of two, a degree-5 polynomial on what is left, the power
built from its bits), with nothing in it that stops LLVM vectorising a loop: 917,504 elements in 0.61 ms against
libm's 4.2-5.3 (one thread, Xeon-AMX), within 1.9e-7 of float64's SiLU where torch's float32 SiLU is within 1.6e-7.
A loop that divides by what `silu` returns must be compiled with `error_model="numpy"`: numba's default checks
every float division for zero, and that branch stops the vectorising.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from hybridpd.engine.model.kernels.bf16_bits import KERNEL_DTYPES, float_from_bits, kernel_array, narrow, widen

_LOG2E = np.float32(1.4426950408889634)
_LN2_HIGH = np.float32(0.693359375)       # ln 2 in two parts (Cody and Waite): k * _LN2_HIGH is exact
_LN2_LOW = np.float32(-2.12194440e-4)
_LOWEST = np.float32(-87.3)               # exp of less is below float32's normal range
_HIGHEST = np.float32(88.3)               # exp of more overflows


@numba.njit(inline="always", fastmath=True)
def exp32(x):  # pragma: no cover - compiled
    """e ** x in float32 (x clamped to [-87.3, 88.3])."""
    x = min(max(x, _LOWEST), _HIGHEST)
    # k = round(x log2 e): the sum is positive, so truncation rounds down. Each integer result is narrowed to
    # int32 at once: numba widens int32 arithmetic to int64, and LLVM cannot vectorise a conversion of that to
    # float32 well (a widening, a 64-bit add and a narrowing for every element).
    k = np.int32(np.int32(x * _LOG2E + np.float32(128.5)) - np.int32(128))
    kf = np.float32(k)
    f = x - kf * _LN2_HIGH - kf * _LN2_LOW
    p = ((((np.float32(1.9875691500e-4) * f + np.float32(1.3981999507e-3)) * f + np.float32(8.3334519073e-3)) * f
          + np.float32(4.1665795894e-2)) * f + np.float32(1.6666665459e-1)) * f + np.float32(5.0000001201e-1)
    p = p * (f * f) + f + np.float32(1.0)
    return p * float_from_bits(np.uint32(np.uint32(k + np.int32(127)) << np.uint32(23)))


@numba.njit(inline="always", fastmath=True)
def silu(x):  # pragma: no cover - compiled
    """x * sigmoid(x) in float32."""
    return x / (np.float32(1.0) + exp32(-x))


_F32_2D = numba.float32[:, ::1]
_U16_2D = numba.uint16[:, ::1]   # bfloat16 as its bits (bf16_bits.py)


@numba.njit([numba.void(rows, rows) for rows in (_F32_2D, _U16_2D)], cache=True, nogil=True, fastmath=True,
            boundscheck=False, error_model="numpy")
def _silu_times_rows(gate_up, out):  # pragma: no cover - compiled
    inter = out.shape[1]
    for t in range(out.shape[0]):
        g, u, o = gate_up[t, :inter], gate_up[t, inter:], out[t]
        for i in range(inter):
            o[i] = narrow(silu(widen(g[i])) * widen(u[i]), out)


def silu_times(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the two halves of a contiguous [T, 2I] `gate_up` (float32 or bfloat16), computed in
    float32 and rounded once to its dtype. One pass: torch's SiLU and product are two (the SiLU's output written and
    read again), and over the strided halves of one output each ran ~3x slower than over contiguous arrays."""
    if (gate_up.dtype not in KERNEL_DTYPES or gate_up.dim() != 2 or gate_up.shape[1] % 2
            or not gate_up.is_contiguous()):
        raise ValueError(f"silu_times: a contiguous [T, 2I] float32 or bfloat16 array only, got "
                         f"{tuple(gate_up.shape)} {gate_up.dtype}")
    out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype)
    _silu_times_rows(kernel_array(gate_up), kernel_array(out))
    return out


@numba.njit([numba.void(rows, rows, rows) for rows in (_F32_2D, _U16_2D)], cache=True, nogil=True, fastmath=True,
            boundscheck=False, error_model="numpy")
def _silu_times_weighted_rows(gate_up, weights, out):  # pragma: no cover - compiled
    experts = weights.shape[1]
    inter = out.shape[1] // experts
    zero = narrow(np.float32(0.0), out)
    for t in range(out.shape[0]):
        for e in range(experts):
            w = widen(weights[t, e])
            o = out[t, e * inter : (e + 1) * inter]
            if w == np.float32(0.0):   # an expert the row did not choose: no SiLU to compute
                for i in range(inter):
                    o[i] = zero
                continue
            g = gate_up[t, 2 * e * inter : (2 * e + 1) * inter]
            u = gate_up[t, (2 * e + 1) * inter : (2 * e + 2) * inter]
            for i in range(inter):
                o[i] = narrow(silu(widen(g[i])) * widen(u[i]) * w, out)


def silu_times_weighted(gate_up: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Every expert's `silu(gate) * up` times the row's weight for that expert: `gate_up` [T, E * 2I] (expert e's gate
    in columns 2eI to (2e + 1)I, its up after it), `weights` [T, E] of the same dtype (0 for an expert the row did
    not choose) -> [T, E * I], expert e in columns eI to (e + 1)I; float32 or bfloat16, computed in float32 and rounded
    once. One pass where torch took three over strided views (a bfloat16 SiLU and two products, each rounded), and
    no SiLU for the experts a row did not choose (E - k of every E)."""
    if (gate_up.dtype not in KERNEL_DTYPES or weights.dtype != gate_up.dtype or gate_up.dim() != 2
            or weights.dim() != 2 or weights.shape[0] != gate_up.shape[0] or not weights.shape[1]
            or gate_up.shape[1] % (2 * weights.shape[1]) or not gate_up.is_contiguous()
            or not weights.is_contiguous()):
        raise ValueError(f"silu_times_weighted: a contiguous [T, E * 2I] and [T, E] of one dtype, float32 or bfloat16, "
                         f"got {tuple(gate_up.shape)} {gate_up.dtype} and {tuple(weights.shape)} {weights.dtype}")
    out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype)
    _silu_times_weighted_rows(kernel_array(gate_up), kernel_array(weights), kernel_array(out))
    return out
