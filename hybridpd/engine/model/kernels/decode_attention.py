"""Decode rows' attention over the DecodeKV buffers in one compiled pass (numba), float32 or bfloat16 (bf16_bits.py):
each row reads only its own keys, `[first, end)` of its buffer row, and the query heads that share a KV head read
each key once between them.

Torch's SDPA over the same buffers takes every row over the columns the widest row needs, masked, and on a CPU its
kernel is built for long query blocks: for one query per row it spent ~450 us a layer of a small-vllm decode step at
batch 8 over ~1,000 keys in bfloat16, 56% of the step (benchmarks/README.md). Here, per row and KV head: the scores
of its query heads (dot products over the head dimension, in float32, four keys at a time), their softmax (the
vectorisable `exp32` of silu.py, the weights left unnormalised), then the values weighted by them, accumulated in
float32, divided by the weights' sum and rounded once to the output's dtype. Results agree with SDPA to float32
rounding in float32, and to one bfloat16 rounding of the output in bfloat16
(tests/unit/engine/model/kernels/test_decode_attention.py).

One thread: the engine's default (`--threads 1`); with more, attention.py keeps SDPA, which splits its work.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch

from hybridpd.engine.model.kernels.bf16_bits import KERNEL_DTYPES, held_array, kernel_array, narrow, widen
from hybridpd.engine.model.kernels.silu import exp32

_I64_1D = numba.int64[::1]


def _signature(element):
    two, four = element[:, ::1], element[:, :, :, ::1]
    return numba.void(
        two,                        # qkv [S, >= H D]: each row's query heads first, KV head g's h-th at g G + h
        four, four,                 # the K and V buffers [>= S, KH, capacity, D]
        _I64_1D, _I64_1D,           # each row's first key and end (its keys: [first, end) of its buffer row)
        numba.int64,                # G: query heads per KV head
        numba.float32,              # the scores' scale
        two,                        # out [S, H D]
    )


@numba.njit(inline="always", boundscheck=False)
def _four_rows(rows, first, last):  # pragma: no cover - compiled
    """Rows first .. first + 3 of `rows`, each past `last` read as row `last` (its weight is 0)."""
    return rows[first], rows[min(first + 1, last)], rows[min(first + 2, last)], rows[min(first + 3, last)]


@functools.cache
def _kernel_for(dim: int):
    """The kernel compiled for head size `dim` (float32 and bfloat16 bits). With the head size a constant, LLVM
    unrolls the loops over it into straight vector code: 0.64-0.73 of the time of one kernel for every head size
    at small-vllm's heads (head size 32, 8-16 rows of 300-1,024 keys, benchmarks/README.md). numba's cache keys a
    closure by the values it holds, so each head size is compiled once per machine."""
    @numba.njit([_signature(element) for element in (numba.float32, numba.uint16)], cache=True, nogil=True,
                fastmath=True, boundscheck=False, error_model="numpy")
    def kernel(qkv, k_buf, v_buf, first, end, group, scale, out):  # pragma: no cover - compiled
        kv_heads = k_buf.shape[1]
        longest = 1
        for s in range(end.shape[0]):
            if first[s] < 0 or end[s] <= first[s] or end[s] > k_buf.shape[2]:
                raise ValueError("decode_attention: every row needs keys within its buffer row")
            longest = max(longest, end[s] - first[s])
        scores = np.empty((group, longest + 3), dtype=np.float32)   # + 3: four keys at a time, 0 past the end
        acc = np.empty((group, dim), dtype=np.float32)
        inverse = np.empty(group, dtype=np.float32)
        for s in range(end.shape[0]):
            lo, n = first[s], end[s] - first[s]
            last = lo + n - 1
            for kh in range(kv_heads):
                base = kh * group * dim
                for h in range(group):
                    for d in range(dim):
                        acc[h, d] = widen(qkv[s, base + h * dim + d]) * scale
                # Four keys' scores at a time: four independent sums over the head size, the query read once.
                for j in range(0, n, 4):
                    k0, k1, k2, k3 = _four_rows(k_buf[s, kh], lo + j, last)
                    for h in range(group):
                        t0 = t1 = t2 = t3 = np.float32(0.0)
                        for d in range(dim):
                            q = acc[h, d]
                            t0 += q * widen(k0[d])
                            t1 += q * widen(k1[d])
                            t2 += q * widen(k2[d])
                            t3 += q * widen(k3[d])
                        scores[h, j], scores[h, j + 1], scores[h, j + 2], scores[h, j + 3] = t0, t1, t2, t3
                for h in range(group):   # the weights unnormalised; the output is divided by their sum once
                    top = scores[h, 0]
                    for j in range(1, n):
                        top = max(top, scores[h, j])
                    total = np.float32(0.0)
                    for j in range(n):
                        e = exp32(scores[h, j] - top)
                        scores[h, j] = e
                        total += e
                    inverse[h] = np.float32(1.0) / total
                    for j in range(n, n + 3):
                        scores[h, j] = np.float32(0.0)
                    for d in range(dim):
                        acc[h, d] = np.float32(0.0)
                # Four keys' values at a time: one load and store of the accumulator for four multiply-adds (one a
                # key made the accumulator's store and load the loop's critical path: 0.7 of the time at four).
                for j in range(0, n, 4):
                    v0, v1, v2, v3 = _four_rows(v_buf[s, kh], lo + j, last)
                    for h in range(group):
                        p0, p1, p2, p3 = scores[h, j], scores[h, j + 1], scores[h, j + 2], scores[h, j + 3]
                        for d in range(dim):
                            acc[h, d] += ((p0 * widen(v0[d]) + p1 * widen(v1[d]))
                                          + (p2 * widen(v2[d]) + p3 * widen(v3[d])))
                for h in range(group):
                    for d in range(dim):
                        out[s, base + h * dim + d] = narrow(acc[h, d] * inverse[h], out)

    return kernel


def decode_attention(qkv: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, first: torch.Tensor,
                     end: torch.Tensor, num_heads: int, scale: float) -> torch.Tensor:
    """Row s's `num_heads` query heads (the first num_heads * D columns of `qkv` [S, ...]) over the keys and values
    `[first[s], end[s])` of buffer row s ([R >= S, KH, capacity, D]) -> [S, num_heads * D] in qkv's dtype."""
    rows, kv_heads, dim = qkv.shape[0], k_buf.shape[1], k_buf.shape[3]
    dtype = qkv.dtype
    if dtype not in KERNEL_DTYPES or k_buf.dtype != dtype or v_buf.dtype != dtype:
        raise ValueError(f"decode_attention: float32 or bfloat16, one dtype, got {dtype}, {k_buf.dtype}, "
                         f"{v_buf.dtype}")
    if (k_buf.shape != v_buf.shape or not k_buf.is_contiguous() or not v_buf.is_contiguous()
            or num_heads % kv_heads or qkv.dim() != 2 or not qkv.is_contiguous() or qkv.shape[1] < num_heads * dim
            or k_buf.shape[0] < rows or first.shape != (rows,) or end.shape != (rows,)):
        raise ValueError(f"decode_attention: shapes do not fit: qkv {tuple(qkv.shape)}, buffers "
                         f"{tuple(k_buf.shape)} / {tuple(v_buf.shape)}, {num_heads} heads, {tuple(first.shape)} rows")
    out = torch.empty((rows, num_heads * dim), dtype=dtype)
    _kernel_for(dim)(kernel_array(qkv), held_array(k_buf), held_array(v_buf), held_array(first), held_array(end),
                     num_heads // kv_heads, np.float32(scale), kernel_array(out))
    return out
