"""A step's attention bookkeeping in one compiled pass (numba), for float32 and bfloat16 models (bf16_bits.py): RoPE
on the rows' query and key heads, then each row's K and V into the paged cache and, for a decode step, into the
DecodeKV buffers.

In torch that is a `roll`, a multiply and a multiply-add for RoPE (the roll allocates) and three advanced-index
writes (the paged cache, the K buffer, the V buffer): six operations per attention layer whose dispatch costs more
than their arithmetic on 16 rows (~45 us per layer for the default model, ~0.2 ms of a decode step). Here a row is
rotated in place in the projection's output and copied where it goes.

RoPE as `RotaryEmbedding.apply_` does it (halves rotated): with cos = (cos f, cos f) and the signed sin =
(-sin f, sin f), x'[d] = x[d] cos[d] + x[d + D/2] sin[d] for d < D/2 and x[d] cos[d] + x[d - D/2] sin[d] above.
Results equal the torch path's to float32 rounding (tests/unit/engine/model/kernels/test_fused_decode_write.py).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from hybridpd.engine.model.kernels.bf16_bits import KERNEL_DTYPES, held, held_array, kernel_array, narrow, widen
from hybridpd.engine.model.kernels.fused_mamba import flat_slots

_I64_1D = numba.int64[::1]
_F32_1D = numba.float32[::1]


def _signatures(element) -> tuple[list, list, list]:
    """The three kernels' signatures for one stored element type: float32, or bfloat16 as its bits (uint16)."""
    one, two, four = element[::1], element[:, ::1], element[:, :, :, ::1]
    write = numba.void(
        two,                      # qkv [S, (H + 2 KH) D]: q heads | k heads | v heads per row (rotated in place)
        two, two,                 # cos, signed sin [S, D]
        numba.int64, numba.int64,  # H, KH
        one, numba.int64, numba.int64,  # the layer's cache, flat; block stride; block size
        _I64_1D, _I64_1D,         # each row's block and offset in it
        four, four,               # the K and V buffers [>= S, KH, >= position + 1, D]
        _I64_1D,                  # each row's position (its buffer column)
    )
    paged = numba.void(two, two, two, numba.int64, numba.int64, one, numba.int64, numba.int64, _I64_1D, _I64_1D)
    rope_row = numba.void(one, two, two, numba.int64, numba.int64, _F32_1D, _F32_1D)
    return write, paged, rope_row


_BY_ELEMENT = [_signatures(element) for element in (numba.float32, numba.uint16)]
_SIGNATURE, _PAGED_SIGNATURE, _ROPE_ROW_SIGNATURE = ([sigs[i] for sigs in _BY_ELEMENT] for i in range(3))


@numba.njit(_ROPE_ROW_SIGNATURE, cache=True, nogil=True, fastmath=True, boundscheck=False)
def _rope_row(row, cos, sin, r, heads, low, high):  # pragma: no cover - compiled
    """Rotates the first `heads` heads of one qkv row in place (q heads, then k heads), with row r of cos / sin."""
    head_dim = cos.shape[1]
    half = head_dim // 2
    c_low, c_high, s_low, s_high = cos[r, :half], cos[r, half:], sin[r, :half], sin[r, half:]
    for h in range(heads):
        # Halves as slices indexed from 0 (not x[d + half]): only that form vectorises.
        x_low = row[h * head_dim : h * head_dim + half]
        x_high = row[h * head_dim + half : (h + 1) * head_dim]
        for d in range(half):
            low[d] = widen(x_low[d]) * widen(c_low[d]) + widen(x_high[d]) * widen(s_low[d])
            high[d] = widen(x_high[d]) * widen(c_high[d]) + widen(x_low[d]) * widen(s_high[d])
        for d in range(half):
            x_low[d] = narrow(low[d], x_low)
            x_high[d] = narrow(high[d], x_high)


@numba.njit(_PAGED_SIGNATURE, cache=True, nogil=True, fastmath=True, boundscheck=False)
def _rope_and_write_paged(qkv, cos, sin, heads, kv_heads, cache, block_stride, block_size, blocks,
                          offsets):  # pragma: no cover - compiled
    head_dim = cos.shape[1]
    token = kv_heads * head_dim
    low, high = np.empty(head_dim // 2, np.float32), np.empty(head_dim // 2, np.float32)
    for r in range(qkv.shape[0]):
        row = qkv[r]
        _rope_row(row, cos, sin, r, heads + kv_heads, low, high)
        at = blocks[r] * block_stride + offsets[r] * token
        cache[at : at + token] = row[heads * head_dim : heads * head_dim + token]
        at += block_size * token  # V follows K in a block
        cache[at : at + token] = row[heads * head_dim + token : heads * head_dim + 2 * token]


@numba.njit(_SIGNATURE, cache=True, nogil=True, fastmath=True, boundscheck=False)
def _rope_and_write(qkv, cos, sin, heads, kv_heads, cache, block_stride, block_size, blocks, offsets, k_buf, v_buf,
                    positions):  # pragma: no cover - compiled
    _rope_and_write_paged(qkv, cos, sin, heads, kv_heads, cache, block_stride, block_size, blocks, offsets)
    head_dim = cos.shape[1]
    for r in range(qkv.shape[0]):  # then each row's (rotated) K and V appended to the buffers
        keys = qkv[r, heads * head_dim : (heads + kv_heads) * head_dim]
        values = qkv[r, (heads + kv_heads) * head_dim : (heads + 2 * kv_heads) * head_dim]
        for kh in range(kv_heads):
            k_buf[r, kh, positions[r]] = keys[kh * head_dim : (kh + 1) * head_dim]
            v_buf[r, kh, positions[r]] = values[kh * head_dim : (kh + 1) * head_dim]


def rope_and_write_(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, cache: torch.Tensor,
    blocks: torch.Tensor, offsets: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, positions: torch.Tensor,
) -> None:
    """Rotates `qkv`'s q and k heads in place ([S, (H + 2 KH) D], contiguous; cos / signed sin [S, 1, D]) and
    writes each row's K and V into `cache` ([blocks, 2, block_size, KH, D], at `blocks[r]`, `offsets[r]`) and into
    the buffers at (row r, position[r]). Every tensor float32, or every one bfloat16 (rotated in float32, rounded
    once)."""
    flat, stride = _held_slots(cache)
    rows = qkv.shape[0]
    _rope_and_write(
        kernel_array(qkv), held_array(cos).reshape(rows, -1), held_array(sin).reshape(rows, -1), num_heads,
        cache.shape[3], flat, stride, cache.shape[2], held_array(blocks), held_array(offsets), held_array(k_buf),
        held_array(v_buf), held_array(positions),
    )


def rope_and_write_paged_(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, cache: torch.Tensor,
    blocks: torch.Tensor, offsets: torch.Tensor,
) -> None:
    """`rope_and_write_` without the buffers: a prefill's (or a mixed step's) rows rotated in place and written into
    the paged cache. On a 4,096-row prefill of the default model it replaces ~4 ms of advanced-index write per
    attention layer, and the RoPE's roll, multiply and multiply-add."""
    flat, stride = _held_slots(cache)
    rows = qkv.shape[0]
    _rope_and_write_paged(kernel_array(qkv), held_array(cos).reshape(rows, -1), held_array(sin).reshape(rows, -1),
                          num_heads, cache.shape[3], flat, stride, cache.shape[2], held_array(blocks),
                          held_array(offsets))


def _held_slots(cache: torch.Tensor) -> tuple[np.ndarray, int]:
    """The cache view's flat array and slot stride (fused_mamba.flat_slots), kept on the view: every step's every
    attention layer writes through it (~3.4 us to make)."""
    return held(cache, "_hybridpd_flat_slots", flat_slots)

