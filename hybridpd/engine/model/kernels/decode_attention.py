"""Decode rows' attention over the DecodeKV buffers in one compiled pass (numba), float32 or bfloat16 (bf16_bits.py):
each row reads only its own keys, `[first, end)` of its buffer row, and the query heads that share a KV head read
each key once between them.

Torch's SDPA over the same buffers takes every row over the columns the widest row needs, masked, and on a CPU its
kernel is built for long query blocks: for one query per row it spent ~450 us a layer of a small-vllm decode step at
batch 8 over ~1,000 keys in bfloat16, 56% of the step (benchmarks/README.md). Here, per row and KV head: the scores
of its query heads a block of keys at a time (key_blocks.py: the block's sums across lanes as one tree), their
softmax (the vectorisable `exp32` of silu.py, the weights left unnormalised), then the values weighted by them a
block at a time, accumulated in float32, divided by the weights' sum and rounded once to the output's dtype. A row's
last block, where fewer keys are left than a block holds, is copied first (its last key repeated, weighted 0), so
nothing past a row's keys is read. Results agree with SDPA to float32 rounding in float32, and to one bfloat16
rounding of the output in bfloat16 (tests/unit/engine/model/kernels/test_decode_attention.py).

One thread: the engine's default (`--threads 1`); with more, attention.py keeps SDPA, which splits its work.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch
from llvmlite import binding

from hybridpd.engine.model.kernels.bf16_bits import KERNEL_DTYPES, held_array, kernel_array, narrow, widen
from hybridpd.engine.model.kernels.key_blocks import block_scores, block_values, prefetch_rows
from hybridpd.engine.model.kernels.silu import exp32

_I64_1D = numba.int64[::1]
# While the scores pass reads a block of keys, the keys AHEAD blocks on and the block's values (read by the values
# pass a little later) are prefetched: a row's keys and values come from memory in two streams at once. The kernel
# alone, 8 rows of 1,088 keys, buffers rotated over 44 MB (from memory): float32 146-151 us against 200 without,
# bfloat16 70 against 84-99; with the buffers in cache 3-10% slower (the prefetches' own instructions).
AHEAD = 8


@functools.cache
def vector_lanes() -> int:
    """Keys a block: the float32 lanes of this CPU's widest vectors (16 with AVX-512, else 8)."""
    return 16 if binding.get_host_cpu_features().get("avx512f", False) else 8


def _signature(element):
    two, four = element[:, ::1], element[:, :, :, ::1]
    return numba.void(
        two,                        # qkv [S, >= H D]: each row's query heads first, KV head g's h-th at g G + h
        four, four,                 # the K and V buffers [>= S, KH, capacity, D]
        _I64_1D, _I64_1D,           # each row's first key and end (its keys: [first, end) of its buffer row)
        numba.float32,              # the scores' scale
        two,                        # out [S, H D]
    )


@numba.njit(inline="always", boundscheck=False)
def _last_block(rows, first, last, block):  # pragma: no cover - compiled
    """Rows first .. first + len(block) - 1 of `rows` into `block`, each past `last` as row `last`."""
    for t in range(block.shape[0]):
        row = rows[min(first + t, last)]
        for d in range(block.shape[1]):
            block[t, d] = row[d]


@functools.cache
def _kernel_for(dim: int, group: int, lanes: int):
    """The kernel compiled for head size `dim`, `group` query heads per KV head and blocks of `lanes` keys: the
    block code (key_blocks.py) takes them as literals and unrolls its loops over them. numba's cache keys a closure
    by the values it holds, so each shape is compiled once per machine."""
    @numba.njit([_signature(element) for element in (numba.float32, numba.uint16)], cache=True, nogil=True,
                fastmath=True, boundscheck=False, error_model="numpy")
    def kernel(qkv, k_buf, v_buf, first, end, scale, out):  # pragma: no cover - compiled
        kv_heads = k_buf.shape[1]
        longest = 1
        for s in range(end.shape[0]):
            if first[s] < 0 or end[s] <= first[s] or end[s] > k_buf.shape[2]:
                raise ValueError("decode_attention: every row needs keys within its buffer row")
            longest = max(longest, end[s] - first[s])
        weights = np.empty((group, longest + lanes), dtype=np.float32)   # + lanes: the last block's spare keys
        queries = np.empty((group, dim), dtype=np.float32)
        acc = np.empty((group, dim), dtype=np.float32)
        top = np.empty((group, lanes), dtype=np.float32)
        inverse = np.empty(group, dtype=np.float32)
        block = np.empty((lanes, dim), dtype=k_buf.dtype)
        for s in range(end.shape[0]):
            lo, n = first[s], end[s] - first[s]
            last = lo + n - 1
            for kh in range(kv_heads):
                base = kh * group * dim
                for h in range(group):
                    for d in range(dim):
                        queries[h, d] = widen(qkv[s, base + h * dim + d]) * scale
                        acc[h, d] = np.float32(0.0)
                    for t in range(lanes):
                        top[h, t] = np.float32(-np.inf)
                keys, values = k_buf[s, kh], v_buf[s, kh]
                for j in range(0, n, lanes):
                    prefetch_rows(keys, lo + j + AHEAD * lanes, lanes)
                    prefetch_rows(values, lo + j, lanes)
                    if j + lanes <= n:
                        block_scores(keys, lo + j, queries, weights, j, top, dim, group, lanes)
                    else:
                        _last_block(keys, lo + j, last, block)
                        block_scores(block, 0, queries, weights, j, top, dim, group, lanes)
                for h in range(group):   # the weights unnormalised; the output is divided by their sum once
                    highest = top[h, 0]
                    for t in range(1, lanes):
                        highest = max(highest, top[h, t])
                    total = np.float32(0.0)
                    for j in range(n):
                        e = exp32(weights[h, j] - highest)
                        weights[h, j] = e
                        total += e
                    inverse[h] = np.float32(1.0) / total
                    for j in range(n, n + lanes):
                        weights[h, j] = np.float32(0.0)
                for j in range(0, n, lanes):
                    if j + lanes <= n:
                        block_values(values, lo + j, weights, j, acc, dim, group, lanes)
                    else:
                        _last_block(values, lo + j, last, block)
                        block_values(block, 0, weights, j, acc, dim, group, lanes)
                for h in range(group):
                    for d in range(dim):
                        out[s, base + h * dim + d] = narrow(acc[h, d] * inverse[h], out)

    return kernel


def prepare(dim: int, group: int) -> None:
    """The kernel for head size `dim` and `group` query heads per KV head compiled (or loaded from numba's cache) now
    rather than at its first call: a node does it at start-up, so that its first decode step does not wait ~2 s for
    the compiler on a machine that never ran the shape."""
    _kernel_for(dim, group, vector_lanes())


def decode_attention(qkv: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, first: torch.Tensor,
                     end: torch.Tensor, num_heads: int, scale: float, lanes: int | None = None) -> torch.Tensor:
    """Row s's `num_heads` query heads (the first num_heads * D columns of `qkv` [S, ...]) over the keys and values
    `[first[s], end[s])` of buffer row s ([R >= S, KH, capacity, D]) -> [S, num_heads * D] in qkv's dtype. `lanes`:
    keys a block (this CPU's `vector_lanes()` unless given)."""
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
    lanes = lanes or vector_lanes()
    if lanes not in (4, 8, 16):
        raise ValueError(f"decode_attention: blocks of 4, 8 or 16 lanes, got {lanes}")
    out = torch.empty((rows, num_heads * dim), dtype=dtype)
    _kernel_for(dim, num_heads // kv_heads, lanes)(
        kernel_array(qkv), held_array(k_buf), held_array(v_buf), held_array(first), held_array(end),
        np.float32(scale), kernel_array(out))
    return out
