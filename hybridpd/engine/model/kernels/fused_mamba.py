"""A Mamba2 layer's step as compiled loops (numba): token by token over each sequence, decode rows and prefill chunks
alike; the only Mamba path the engine has. The conv state is float32; the SSM state float32 or, in a bfloat16 model,
bfloat16 (computed in float32, rounded once per step where it is stored: a decode step reads and writes every
running request's state, and bfloat16 halves those bytes).

As torch operations a decode step is ~25 tensor operations per layer on tensors of a few kB each (the convolution
window, SiLU, softplus, the state update, the read-out, the gated norm): each costs its dispatch more than its
arithmetic, ~250 us per layer for 16 rows of the default model, and a prefill needs a chunked scan with its own
layouts. Here a step is three passes over all its rows (`mamba_rows_`):

1. `_conv_rows` (compiled): the causal convolution and its SiLU, each output reading its K inputs where they are
   (this step's rows of in_proj's output, or the slot's window for those before the step); the window is written
   once at the end;
2. `_scan_rows` (compiled): softplus, the state update and read-out with the D skip (a prefill chunk's states held
   in a float32 scratch while its rows pass, ROW_BLOCK rows at a time through every head, four rows in each pass
   over a head's state; a decode row's updated where they sit in the cache), then the gated norm row by row, the
   gate's SiLU taken where it is read.

The SiLUs are silu.py's, which LLVM vectorises (numba's own exp is libm's, one element at a time: that made them half
of a one-pass kernel's time, so they used to be torch's, a pass of their own over each array).

16 decode rows of the default model: ~80 us per layer (~1 ms less per decode step than the torch operations); a
16 x 256 prefill: ~8.5 ms per layer, about half of a chunked scan's in torch with its layouts and the gated norm.

Per row (token) of a sequence, with C = conv_dim, I = intermediate, H heads of P channels, G groups of N:

    conv  = silu(bias + sum_k inputs[t - K + 1 + k] * weight[k])   (inputs before the step: the slot's window)
    x, B, C = conv[:I] as [H, P], conv[I : I + G N] as [G, N], conv[I + G N :] as [G, N]
    dt_h  = clamp(softplus(dt_raw_h + dt_bias_h), dt_min, dt_max)
    S_h   = exp(dt_h A_h) S_h + dt_h x_h B_g^T              y_h = S_h C_g + D_h x_h   (g = h's group)
    out   = norm_weight * rmsnorm_per_group(y * silu(gate))   (groups of `norm_group` channels; or, per the layer's
            shapes.MambaNorm, y * silu(gate), or norm_weight * rmsnorm_per_group(y) * silu(gate))

A sequence starts from its slot's states (resumed) or from zeros; after the rows the scheduler named, the states
are also copied to other slots (prefix-cache saves). Accumulations are float32, as torch's are; sums run in another
order, so results agree with transformers' to float32 rounding, not bit for bit (test_fused_mamba.py against the
formulas in float64; tests/oracle against transformers, chunked prefills, decodes, preemption and prefix hits on saved
states included). Loops index slices from 0 (`y[start:end][c]`, not `y[start + c]`): only that form vectorises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
import torch

from hybridpd.engine.model.kernels.bf16_bits import kernel_array, narrow, widen
from hybridpd.engine.model.kernels.silu import silu
from hybridpd.engine.model.step.mamba_meta import MambaRows

_F32_1D = numba.float32[::1]
_F32_2D = numba.float32[:, ::1]
_U16_2D = numba.uint16[:, ::1]   # bfloat16 as its bits (bf16_bits.py)
_I64_1D = numba.int64[::1]
_SEQUENCES = (
    _I64_1D, _I64_1D, _I64_1D, _I64_1D,  # per sequence: first row, rows, resumed (0/1), slot
    _I64_1D, _I64_1D, _I64_1D,  # per save: sequence, rows of the step after which to save, slot (by sequence)
)
def _conv_signature(proj: numba.types.Array) -> numba.core.typing.templates.Signature:
    return numba.void(
        proj,                     # in_proj's output [T, I + C + H]: gate | xbc | dt_raw (float32 or bfloat16 bits)
        *_SEQUENCES,
        _F32_1D, numba.int64,     # conv cache: slot s's [K - 1, C] state at [s * stride, ...) of this flat array
        _F32_2D,                  # conv weight [K, C]
        _F32_1D,                  # conv bias [C] (zeros when the layer has none)
        numba.int64,              # where xbc starts in a row of that array
        _F32_2D,                  # out: silu(the convolution) [T, C]
    )


def _scan_signature(proj: numba.types.Array, state: numba.types.Array,
                    result: numba.types.Array) -> numba.core.typing.templates.Signature:
    return numba.void(
        _F32_2D,                  # silu(conv) [T, C]: x | B | C per row
        proj,                     # in_proj's output, as the convolution's: the gate and dt_raw read from it
        *_SEQUENCES,
        state, numba.int64,       # ssm cache: slot s's [H, P, N] state at [s * stride, ...) of this flat array
        numba.int64, numba.int64, numba.int64,  # H, P, N
        _F32_1D, _F32_1D, _F32_1D,  # dt_bias, A (negative), D: [H]
        numba.float32, numba.float32,  # dt_min, dt_max
        _F32_1D,                  # gated-norm weight [I]
        numba.int64,              # gated-norm group size
        numba.float32,            # gated-norm eps
        numba.int64,              # how y meets the gate (shapes.MambaNorm: 0 gated norm, 1 gate only, 2 norm then gate)
        numba.int64,              # groups (G)
        _F32_2D,                  # y [T, I] (scratch: the read-outs before the gated norm)
        result,                   # out [T, I]: float32 (y itself may be passed) or bfloat16 bits, as in_proj's output
    )


# in_proj's output in float32, or a bfloat16 model's as its bits, read where it lies (widened where read: a copy
# widened to float32 beforehand took ~6% of a 512-token bfloat16 prefill of granite-350m inside the engine, ~4 ms a
# layer), and the output written in the same dtype (rounded where stored, not copied afterwards); the SSM cache in
# float32, or in bfloat16 as its bits (a bfloat16 model's).
_CONV_SIGNATURES = [_conv_signature(proj) for proj in (_F32_2D, _U16_2D)]
_SCAN_SIGNATURES = [_scan_signature(proj, state, proj)
                    for proj, state in ((_F32_2D, _F32_1D), (_F32_2D, numba.uint16[::1]), (_U16_2D, numba.uint16[::1]))]


@numba.njit(inline="always", fastmath=True, boundscheck=False)
def _widen_into(dst, src):  # pragma: no cover - compiled
    """A float32 row `dst` from a row of float32 or bfloat16 bits."""
    for c in range(dst.shape[0]):
        dst[c] = widen(src[c])


@numba.njit(_CONV_SIGNATURES, cache=True, nogil=True, fastmath=True, boundscheck=False, error_model="numpy")
def _conv_rows(proj, seq_start, seq_rows, seq_resumed, seq_slot, save_seq, save_after, save_slot, conv_cache,
               conv_stride, conv_w, conv_b, inner, out):  # pragma: no cover - compiled
    """Output row t of a sequence reads its inputs t - (K - 1) .. t straight where they are: this step's rows of
    in_proj's output, or the slot's window for those before the step. The window is written once, at the end (and
    a saved one assembled the same way), not shifted row by row: half the time of shifting on a prefill chunk."""
    width, conv_dim = conv_w.shape[0], conv_w.shape[1]
    history = width - 1
    next_save = 0
    for q in range(seq_start.shape[0]):
        at = seq_slot[q] * conv_stride
        window = conv_cache[at : at + history * conv_dim].reshape((history, conv_dim))
        if seq_resumed[q] == 0:  # a first chunk starts from zeros (the slot may hold an earlier owner's state)
            window[:, :] = 0.0
        first, n = seq_start[q], seq_rows[q]
        for t in range(n):
            conv = out[first + t]
            conv[:] = conv_b
            for k in range(width):
                j = t - history + k  # the sequence's input row in this step; negative: in the window
                wk = conv_w[k]
                if j >= 0:
                    source = proj[first + j, inner : inner + conv_dim]
                    for c in range(conv_dim):
                        conv[c] += widen(source[c]) * wk[c]
                else:
                    earlier = window[history + j]
                    for c in range(conv_dim):
                        conv[c] += earlier[c] * wk[c]
            for c in range(conv_dim):
                conv[c] = silu(conv[c])
            while next_save < save_seq.shape[0] and save_seq[next_save] == q and save_after[next_save] == t + 1:
                at = save_slot[next_save] * conv_stride
                saved = conv_cache[at : at + history * conv_dim].reshape((history, conv_dim))
                for i in range(history):
                    j = t + 1 - history + i
                    if j >= 0:
                        _widen_into(saved[i], proj[first + j, inner : inner + conv_dim])
                    else:
                        saved[i, :] = window[history + j]
                next_save += 1
        if n >= history:  # the window becomes the sequence's last K - 1 inputs
            for i in range(history):
                _widen_into(window[i], proj[first + n - history + i, inner : inner + conv_dim])
        else:
            for i in range(history - n):
                window[i, :] = window[i + n]
            for i in range(n):
                _widen_into(window[history - n + i], proj[first + i, inner : inner + conv_dim])


@numba.njit(inline="always", fastmath=True, boundscheck=False)
def _dt_and_decay(dt_raw, dt_bias, A, dt_min, dt_max):  # pragma: no cover - compiled
    """A row's step size for a head (softplus, threshold 20, clamped) and its state's decay exp(dt A)."""
    v = dt_raw + dt_bias
    dt = v if v > np.float32(20.0) else np.float32(math.log1p(math.exp(v)))
    dt = min(max(dt, dt_min), dt_max)
    return dt, np.float32(math.exp(dt * A))


@numba.njit(inline="always", fastmath=True, boundscheck=False)
def _head_row(state, conv, dt_raw, dt_bias, A, D, dt_min, dt_max, inner, groups, g, h, out_row):  # pragma: no cover
    """One row's update of head h's state `state` [P, N] (the cache's own memory, float32 or bfloat16 bits, or a
    float32 scratch: read widened, stored narrowed) and its read-out into the head's channels of `out_row`."""
    head_dim, d_state = state.shape
    dt, decay = _dt_and_decay(dt_raw, dt_bias, A, dt_min, dt_max)
    # Slices, not offsets into `conv`: with B, C, x and y as arrays of their own, LLVM vectorises the state loop
    # (indexing `conv` there while writing the state made it ~3x slower).
    Bg = conv[inner + g * d_state : inner + (g + 1) * d_state]
    Cg = conv[inner + (groups + g) * d_state : inner + (groups + g + 1) * d_state]
    xh = conv[h * head_dim : (h + 1) * head_dim]
    yh = out_row[h * head_dim : (h + 1) * head_dim]
    for p in range(head_dim):
        xv = xh[p]
        xdt = dt * xv
        s = state[p]
        acc = np.float32(0.0)
        for n in range(d_state):
            value = widen(s[n]) * decay + xdt * Bg[n]
            s[n] = narrow(value, state)
            acc += value * Cg[n]
        yh[p] = acc + D * xv


@numba.njit(inline="always", fastmath=True, boundscheck=False)
def _head_four_rows(state, xbc, proj, r, dt_at, dt_bias, A, D, dt_min, dt_max, inner, groups, g, h,
                    out):  # pragma: no cover - compiled
    """Rows r .. r + 3 of head h on a float32 `state` [P, N] (a prefill's scratch), in one pass over the state:
    each element is read and stored once for the four rows, its four updates chained in registers, and the four
    read-outs accumulate side by side. One row at a time, a row's read-out is a chain of dependent sums, each waiting
    for the one before; four chains fill the gaps. One granite-350m layer, the scan alone on the inputs the engine
    handed it (captured), one thread, rounds alternated: 2,048 float32 rows 37.8 / 40.5 ms (medians of two runs)
    against 86.8 / 54.4 a row at a time, 512 rows with a bfloat16 state 9.8 against 12.8. The same arithmetic as four
    `_head_row` calls; the multiply-adds may fuse otherwise, so results agree with them to float32 rounding, not to
    the bit."""
    head_dim, d_state = state.shape
    b_at, c_at = inner + g * d_state, inner + (groups + g) * d_state
    x_at = h * head_dim
    dt0, d0 = _dt_and_decay(widen(proj[r, dt_at]), dt_bias, A, dt_min, dt_max)
    dt1, d1 = _dt_and_decay(widen(proj[r + 1, dt_at]), dt_bias, A, dt_min, dt_max)
    dt2, d2 = _dt_and_decay(widen(proj[r + 2, dt_at]), dt_bias, A, dt_min, dt_max)
    dt3, d3 = _dt_and_decay(widen(proj[r + 3, dt_at]), dt_bias, A, dt_min, dt_max)
    B0, B1 = xbc[r, b_at : b_at + d_state], xbc[r + 1, b_at : b_at + d_state]
    B2, B3 = xbc[r + 2, b_at : b_at + d_state], xbc[r + 3, b_at : b_at + d_state]
    C0, C1 = xbc[r, c_at : c_at + d_state], xbc[r + 1, c_at : c_at + d_state]
    C2, C3 = xbc[r + 2, c_at : c_at + d_state], xbc[r + 3, c_at : c_at + d_state]
    x0, x1 = xbc[r, x_at : x_at + head_dim], xbc[r + 1, x_at : x_at + head_dim]
    x2, x3 = xbc[r + 2, x_at : x_at + head_dim], xbc[r + 3, x_at : x_at + head_dim]
    y0, y1 = out[r, x_at : x_at + head_dim], out[r + 1, x_at : x_at + head_dim]
    y2, y3 = out[r + 2, x_at : x_at + head_dim], out[r + 3, x_at : x_at + head_dim]
    for p in range(head_dim):
        xa, xb, xc, xd = dt0 * x0[p], dt1 * x1[p], dt2 * x2[p], dt3 * x3[p]
        s = state[p]
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        a3 = np.float32(0.0)
        for n in range(d_state):
            v0 = s[n] * d0 + xa * B0[n]
            v1 = v0 * d1 + xb * B1[n]
            v2 = v1 * d2 + xc * B2[n]
            v3 = v2 * d3 + xd * B3[n]
            s[n] = v3
            a0 += v0 * C0[n]
            a1 += v1 * C1[n]
            a2 += v2 * C2[n]
            a3 += v3 * C3[n]
        y0[p] = a0 + D * x0[p]
        y1[p] = a1 + D * x1[p]
        y2[p] = a2 + D * x2[p]
        y3[p] = a3 + D * x3[p]


@numba.njit(inline="always", fastmath=True, boundscheck=False)
def _copy_state(dst, src):  # pragma: no cover - compiled
    """[P, N] `src` into `dst`, each float32 or bfloat16 bits (widened where read, narrowed where stored)."""
    for p in range(src.shape[0]):
        d, s = dst[p], src[p]
        for n in range(src.shape[1]):
            d[n] = narrow(widen(s[n]), dst)


@numba.njit(inline="always", fastmath=True, boundscheck=False)
def _head_state(cache, at, h, head_dim, d_state):  # pragma: no cover - compiled
    """Head h's [P, N] state in the flat SSM cache, of the slot whose states start at `at`."""
    size = head_dim * d_state
    return cache[at + h * size : at + (h + 1) * size].reshape((head_dim, d_state))


# A prefill chunk's rows go through the scan in blocks of this many, every head through a block before the next
# block: the block's rows (B and C, shared by a group's heads) stay in the L1 / L2 cache while the heads pass. One
# granite-350m layer on the inputs the engine handed it, one thread: 2,048 rows in float32 76-80 ms at blocks of 8,
# 81-87 at 16, 81-86 at 32, 102-109 at 64, against 114-123 head by head over all rows; 512 rows with a bfloat16
# state 14.3-18.5 at 8, 14.2-14.7 at 16, 14.4-22.9 at 32, against 19-24 (16: within a few percent of the best at
# either length, and the steadiest). The block size leaves the results as they are, to the bit: each head's sums run
# in the same order (blocks of a multiple of four rows start the four-row passes where they would start anyway). Since
# a head's state is passed four rows at a time (`_head_four_rows`) the block size hardly matters: the scan alone on
# the same inputs, rounds alternated, medians 58.0 / 57.7 / 60.5 / 59.8 ms at 8 / 16 / 32 / 64 (2,048 float32 rows,
# a slow hour) and 9.5 / 9.6 / 9.7 at 8 / 16 / 32 (512 rows, bfloat16 state).
ROW_BLOCK = 16


@numba.njit(_SCAN_SIGNATURES, cache=True, nogil=True, fastmath=True, boundscheck=False, error_model="numpy")
def _scan_rows(xbc, proj, seq_start, seq_rows, seq_resumed, seq_slot, save_seq, save_after, save_slot,
               ssm_cache, ssm_stride, heads, head_dim, d_state, dt_bias, A, D, dt_min, dt_max, norm_w, norm_group,
               eps, norm_mode, groups, out, result):  # pragma: no cover - compiled
    """A decode row (a sequence of one row) updates each head's state where it sits in the cache. A sequence of
    several rows (a prefill chunk) holds its states ([H, P, N], 786 kB on the published shapes) in a float32
    scratch, read from the cache once and stored once (rounded there when the cache is bfloat16), and goes through
    them ROW_BLOCK rows at a time, head by head within a block, four rows at a time within a head (one row at a
    time where a save falls among the four). Then the gated norm, row by row, over every head's y (`out`) and the
    SiLU of the gate (`proj`'s first I columns), into `result` (rounded there when it is bfloat16)."""
    inner = heads * head_dim
    dt_at = proj.shape[1] - heads
    per_group = heads // groups
    first_save = 0
    for q in range(seq_start.shape[0]):
        at = seq_slot[q] * ssm_stride
        while first_save < save_seq.shape[0] and save_seq[first_save] < q:
            first_save += 1
        n = seq_rows[q]
        if n == 1:
            r = seq_start[q]
            for h in range(heads):
                cached = _head_state(ssm_cache, at, h, head_dim, d_state)
                if seq_resumed[q] == 0:
                    cached[:, :] = 0
                _head_row(cached, xbc[r], widen(proj[r, dt_at + h]), dt_bias[h], A[h], D[h], dt_min, dt_max, inner, groups,
                          h // per_group, h, out[r])
                next_save = first_save
                while next_save < save_seq.shape[0] and save_seq[next_save] == q:
                    _copy_state(_head_state(ssm_cache, save_slot[next_save] * ssm_stride, h, head_dim, d_state), cached)
                    next_save += 1
            continue
        states = np.empty((heads, head_dim, d_state), dtype=np.float32)
        if seq_resumed[q] == 0:
            states[:, :, :] = 0
        else:
            for h in range(heads):
                _copy_state(states[h], _head_state(ssm_cache, at, h, head_dim, d_state))
        block_save = first_save  # the sequence's first save after the block's first row
        for block in range(0, n, ROW_BLOCK):
            while block_save < save_seq.shape[0] and save_seq[block_save] == q and save_after[block_save] <= block:
                block_save += 1
            for h in range(heads):
                state = states[h]
                next_save = block_save
                t, end = block, min(block + ROW_BLOCK, n)
                while t < end:
                    # four rows at once unless a save falls inside them
                    until = end
                    if next_save < save_seq.shape[0] and save_seq[next_save] == q:
                        until = min(until, save_after[next_save])
                    r = seq_start[q] + t
                    if t + 4 <= until:
                        _head_four_rows(state, xbc, proj, r, dt_at + h, dt_bias[h], A[h], D[h], dt_min, dt_max,
                                        inner, groups, h // per_group, h, out)
                        t += 4
                    else:
                        _head_row(state, xbc[r], widen(proj[r, dt_at + h]), dt_bias[h], A[h], D[h], dt_min, dt_max,
                                  inner, groups, h // per_group, h, out[r])
                        t += 1
                    while next_save < save_seq.shape[0] and save_seq[next_save] == q and save_after[next_save] == t:
                        _copy_state(_head_state(ssm_cache, save_slot[next_save] * ssm_stride, h, head_dim, d_state),
                                    state)
                        next_save += 1
        for h in range(heads):
            _copy_state(_head_state(ssm_cache, at, h, head_dim, d_state), states[h])
    for r in range(out.shape[0]):
        y, gr, res = out[r], proj[r], result[r]
        for start in range(0, inner, norm_group):
            # Slices indexed from 0 (not y[start + c]): only that form vectorises, ~9x faster.
            end = start + norm_group
            yg, gg, wg, rg = y[start:end], gr[start:end], norm_w[start:end], res[start:end]
            if norm_mode == 1:
                for c in range(norm_group):
                    rg[c] = narrow(yg[c] * silu(widen(gg[c])), result)
                continue
            square = np.float32(0.0)
            if norm_mode == 0:
                for c in range(norm_group):
                    value = yg[c] * silu(widen(gg[c]))
                    yg[c] = value
                    square += value * value
            else:
                for c in range(norm_group):
                    square += yg[c] * yg[c]
            scale = np.float32(1.0) / np.sqrt(square / np.float32(norm_group) + eps)
            if norm_mode == 0:
                for c in range(norm_group):
                    rg[c] = narrow(yg[c] * scale * wg[c], result)
            else:
                for c in range(norm_group):
                    rg[c] = narrow(yg[c] * scale * wg[c] * silu(widen(gg[c])), result)


def _f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


def flat_slots(cache: torch.Tensor) -> tuple[np.ndarray, int]:
    """A cache view [slots, ...] whose slots (blocks) are each contiguous but lie `stride` elements apart (a layer's
    part of the KV storage rows) -> one flat contiguous array from slot 0's first element over the last slot's
    last one, and that stride: a kernel then reads a slot as a contiguous block."""
    slot = cache[0]
    if not slot.is_contiguous():
        raise ValueError("a cache slot must be contiguous")
    span = (cache.shape[0] - 1) * cache.stride(0) + slot.numel()
    return kernel_array(cache.as_strided((span,), (1,))), cache.stride(0)


@dataclass(frozen=True)
class MambaKernelCaches:
    """A layer's conv and SSM caches as the kernels address them (numpy views of the same memory)."""

    conv: np.ndarray
    conv_stride: int
    ssm: np.ndarray
    ssm_stride: int
    state_shape: tuple[int, int, int]  # H, P, N

    @classmethod
    def of(cls, conv_cache: torch.Tensor, ssm_cache: torch.Tensor) -> MambaKernelCaches:
        conv, conv_stride = flat_slots(conv_cache)
        ssm, ssm_stride = flat_slots(ssm_cache)
        heads, head_dim, d_state = ssm_cache.shape[1:]
        return cls(conv, conv_stride, ssm, ssm_stride, (heads, head_dim, d_state))


@dataclass(frozen=True)
class MambaKernelWeights:
    """A layer's parameters as the kernels take them (numpy views of the float32 tensors; no copies)."""

    conv_weight: np.ndarray  # [K, C]
    conv_bias: np.ndarray    # [C], zeros when the layer has none
    dt_bias: np.ndarray
    A: np.ndarray            # negative
    D: np.ndarray
    dt_limit: tuple[np.float32, np.float32]
    norm_weight: np.ndarray  # [I] (ones when the layer has no norm)
    norm_group: int
    eps: np.float32
    norm_mode: int           # shapes.MambaNorm
    groups: int

    @classmethod
    def of(cls, conv_weight: torch.Tensor, conv_bias: torch.Tensor, dt_bias: torch.Tensor, A: torch.Tensor,
           D: torch.Tensor, dt_limit: tuple[float, float], norm_weight: torch.Tensor, norm_group: int, eps: float,
           groups: int, norm_mode: int = 0) -> MambaKernelWeights:
        return cls(_f32(conv_weight), _f32(conv_bias), _f32(dt_bias), _f32(A), _f32(D),
                   (np.float32(dt_limit[0]), np.float32(dt_limit[1])), _f32(norm_weight), norm_group,
                   np.float32(eps), int(norm_mode), groups)


def mamba_rows_(
    proj: torch.Tensor, rows: MambaRows, caches: MambaKernelCaches, weights: MambaKernelWeights,
) -> torch.Tensor:
    """Every row of in_proj's output, sequence by sequence as `rows` lays them out; the states in the caches updated
    in place and saved where `rows` asks -> the gated-normed output [T, I] in `proj`'s dtype.

    `proj` is in_proj's whole output, a contiguous [T, I + C + H] (gate | xbc | dt_raw), float32 or bfloat16 (read
    as its bits, widened where read; then the SSM cache must be bfloat16 too): the kernel reads the gate from its
    first I columns, xbc and dt_raw from the rest, where they lie.

    Two compiled passes: the convolution and its SiLU (it walks each sequence's window), then the scan and the gated
    norm with the gate's SiLU."""
    conv_dim = weights.conv_weight.shape[1]
    heads, head_dim, _ = caches.state_shape
    inner = heads * head_dim
    if proj.dim() != 2 or proj.shape[1] != inner + conv_dim + heads:
        raise ValueError(f"mamba_rows_: in_proj's output is {tuple(proj.shape)}, the layer's rows are "
                         f"[T, {inner + conv_dim + heads}] (gate {inner} | xbc {conv_dim} | dt {heads})")
    if not proj.is_contiguous():
        raise ValueError("mamba_rows_: in_proj's output must be contiguous")
    sequences = (rows.starts, rows.lengths, rows.resumed, rows.slots, rows.save_seqs, rows.save_after,
                 rows.save_slots)
    conv = torch.empty(proj.shape[0], conv_dim, dtype=torch.float32)
    source, conv_np = kernel_array(proj), conv.numpy()
    _conv_rows(source, *sequences, caches.conv, caches.conv_stride, weights.conv_weight, weights.conv_bias, inner,
               conv_np)
    out = torch.empty(proj.shape[0], inner, dtype=torch.float32)
    result = out if proj.dtype == torch.float32 else torch.empty(out.shape, dtype=proj.dtype)
    _scan_rows(
        conv_np, source, *sequences, caches.ssm, caches.ssm_stride, *caches.state_shape,
        weights.dt_bias, weights.A, weights.D, *weights.dt_limit, weights.norm_weight, weights.norm_group,
        weights.eps, weights.norm_mode, weights.groups, out.numpy(), kernel_array(result),
    )
    return result
