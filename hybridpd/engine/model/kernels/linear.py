"""A step's projections (`F.linear`); a step of a whole number of ONEDNN_ROWS rows goes through oneDNN, and a
decode step's few rows times a large weight through the few-rows kernel (few_rows.py). In bfloat16 on a CPU without
bfloat16 units, see `bf16_linear`; on one with them, every product goes through the weight packed for oneDNN
(packed.py), as do float32's on a CPU with AVX-512 whose MKL runs generic code (not Intel's), but for one row by a
large weight: there, and for float32 wherever MKL runs generic code, that goes through the one-row kernel
(few_rows.py), which reads the weight faster (on the EPYC with AVX-512 and bfloat16 units: 34-35 against the packed
product's 32-33 GB/s in bfloat16, 35-39 against 32-35 in float32), but in bfloat16 on a CPU with AMX
(`own_loops_pay`) and, by a weight that streams from memory, on Intel's (ONE_ROW_MAX_WEIGHT_BF16_INTEL). On an Intel
CPU with AVX512-BF16 and no AMX, a bfloat16 product of many rows (a prefill's, a large decode step's) is widened to
float32 for MKL instead, whose float32 kernels there outrun oneDNN's bfloat16 ones (WIDEN_ROWS_MIN; a small weight
through a float32 copy kept beside it).

The few-rows kernel takes 2 to FEW_ROWS_MAX rows against a float32 weight of at least FEW_ROWS_MIN_WEIGHT elements:
there it runs the projections in 0.4-0.7 of MKL's time on the EPYC guest (few_rows.py); below that size its call
costs ~15 us more than MKL's, which on the small presets' weights (128-1,024 wide) is more than it saves; at 16 rows
the two are even, from 32 MKL is ahead. Where MKL runs Intel's own kernels it does better on a few rows: on the
Xeon with AVX512-BF16 (benchmarks/README.md), granite-350m's decode steps took 0.88-0.99x as long through the kernel
at 2 rows, 0.92-0.97 at 3, and 0.84 at 4, 6 and 8 (`decode_kernels.py`, the kernel taking four columns at a time;
one column at a time it had taken 1.44-1.54x at 2 rows and 0.81-0.93 at 8), so there it takes FEW_ROWS_MIN_INTEL
rows and up only.

Measured on an x86 CPU with AVX-512, one thread (benchmarks/README.md names the machines): MKL, which `F.linear` calls, runs the model's projections
(128-256 inputs, 128-580 outputs) at 75-85 GFLOP/s over 2,048-4,096 rows, where oneDNN's matmul
(`torch.ops.mkldnn._linear_pointwise`, the weight taken as it is) runs them at 90-100; from a few hundred rows down
both reach the same ~100 GFLOP/s. A step of a whole multiple of 1,024 rows (prompts whose lengths add up to it, such
as 16 x 256 or 8 x 256, a 1,024- or 4,096-token prompt alone, a full 2,048-token step when the chunk boundaries
allow) takes its products there: 8-25% less time for them, more with more rows (a 16 x 256 prefill step of the
default model 275 -> 245 ms, an 8 x 256 one 137 -> 125 ms, in-process, alternating). Other steps are unchanged.
On a CPU with AVX2 alone (`onednn_rows_pay`) the step's products stay with MKL: on the AMD EPYC with AVX2, one thread,
MKL ran granite-350m's projections at 85-90 GFLOP/s over 1,024 and 2,048 rows (the machine's matmul peak), oneDNN's
unpacked product at 1.0-1.33x its time, and that preset's 2,048-token prefill took 1.15x as long through oneDNN
(small-vllm's 1,024 / 2,048-token ones 1.02 / 0.97x; one engine, alternated).

Only whole multiples: oneDNN builds and caches a primitive, with scratch memory, per shape it meets; given every
row count a server sees, the process grew by ~1 GB per 1,000 distinct counts (measured), and sending the rows of
other steps in part (a multiple through oneDNN, the rest through MKL, joined by a copy) was slower than MKL alone.
So it meets at most max_num_batched_tokens / ONEDNN_ROWS row counts per weight shape (~13 MB for the default
model's shapes at 1,024 and 2,048 rows). Results agree with MKL's to float32 rounding (another summation order;
tests/unit/engine/model/kernels/test_linear.py), as a step's results already depend on how it is chunked.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridpd.engine.dtype_choice import BF16_FLAGS, this_cpus_flags, this_cpus_vendor
from hybridpd.engine.model.kernels.few_rows import few_rows_linear, few_rows_linear_bf16, one_row_linear
from hybridpd.engine.model.kernels.packed import (
    float32_packs_pay, kept_wide_linear, mkl_runs_generic, packed_linear, packing_works, tiny_work,
)

# Steps of a multiple of this many rows go to oneDNN.
ONEDNN_ROWS = 1024
FEW_ROWS_MAX = 8
FEW_ROWS_MIN_INTEL = 4   # where MKL runs Intel's own kernels: from this many rows (below, MKL is as fast)
FEW_ROWS_MIN_WEIGHT = 2**20
# One row by a weight of at least this many elements goes through the one-row kernel where products pack (below,
# MKL's product costs less: on the EPYC with AVX512-BF16, float32 384 x 128 3.9 against 4.8 us, 768 x 128 6.2 against
# 5.8); bfloat16's from fewer (there the small products' other path widens the row and narrows the result around
# MKL's: 256 x 128 5.6 against 6.0 us, 512 x 128 6.6 against 7.4, with the weight's array kept: bf16_bits.held_array).
ONE_ROW_MIN_WEIGHT = 2**17
ONE_ROW_MIN_WEIGHT_BF16 = 2**15
# ... and in bfloat16 on an Intel CPU, to a weight of fewer elements than this: a larger one the packed product reads
# from memory faster there (Xeon with AVX512-BF16 and no AMX, one row by weights streamed from memory, us a call,
# packed against the loop: 768 x 768 115 / 157, 768 x 1,536 233 / 340, 4,096 x 768 540-700 / 850; 256 x 768 60 / 60,
# 580 x 128 31 / 28), where on the EPYC with AVX512-BF16 the loop read it faster.
ONE_ROW_MAX_WEIGHT_BF16_INTEL = 2**18
# bfloat16 where products pack (not on a CPU with AMX, where it was not measured): a few rows by a small weight
# through the bfloat16 few-rows kernel. One engine, decode steps alternated with the packed and small-product paths
# (EPYC with AVX512-BF16): small-vllm 0.78 / 0.63 / 0.86 / 0.92 of the step at 2 / 4 / 8 / 12 rows, 0.98 at 16.
SMALL_BF16_ROWS_MAX = 12
SMALL_BF16_WEIGHT_BELOW = 2**17
# bfloat16 without bfloat16 units: up to this many rows the bfloat16 few-rows kernel (a small weight: from 2 rows).
BF16_FEW_ROWS_MAX = 32
BF16_FEW_ROWS_MAX_SMALL_WEIGHT = 16
WIDEN_ELEMENTS = 1 << 21   # weight elements widened to float32 at a time (8 MiB)
# bfloat16 on an Intel CPU with AVX512-BF16 and no AMX: products of at least this many rows are widened to float32
# for MKL (`widened_linear`), from WIDEN_ROWS_MIN_SMALL_WEIGHT by a weight of fewer than ONE_ROW_MIN_WEIGHT elements.
# oneDNN's bfloat16 products run there at ~85-90 GFLOP/s (granite-350m's projections, 256 and 2,048 rows), MKL's
# float32 ones at 145-170 and widened ones at 133-157. Those shapes' weights streamed from memory, one thread, the
# widened product's time over the packed one's: 1.28 at 32 rows, 0.93 at 64, 0.75 at 128, 0.65 at 256; small-vllm's
# (cached): 1.01 at 8, 0.81 at 16, 0.72 at 256.
WIDEN_ROWS_MIN = 64
WIDEN_ROWS_MIN_SMALL_WEIGHT = 16


def _find_onednn() -> Callable[..., torch.Tensor] | None:
    """oneDNN's linear, if this torch build has one that runs (else every product is MKL's)."""
    if not torch.backends.mkldnn.is_available():
        return None
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None:
        return None
    try:
        op(torch.zeros(1, 4), torch.zeros(2, 4), None, "none", [], "")
    except RuntimeError:
        return None
    return op


def onednn_rows_pay(flags: frozenset[str]) -> bool:
    """Whether a step of a whole multiple of ONEDNN_ROWS float32 rows goes through oneDNN on a CPU with these
    /proc/cpuinfo flags: where it has AVX-512 (module docstring)."""
    return "avx512f" in flags


_cpu_flags = this_cpus_flags()
_onednn = _find_onednn() if onednn_rows_pay(_cpu_flags) else None
_bf16_units = bool(_cpu_flags & BF16_FLAGS)
_bf16_packing = _bf16_units and packing_works()
_vendor = this_cpus_vendor()
_f32_packing = float32_packs_pay(_vendor, _cpu_flags) and packing_works(torch.float32)
_f32_own_loops = mkl_runs_generic(_vendor)   # one float32 row by a large weight: the one-row kernel
_tiny_work = {dtype: tiny_work(dtype, _vendor) for dtype in (torch.float32, torch.bfloat16)}
_amx = "amx_bf16" in _cpu_flags
_intel = not mkl_runs_generic(_vendor)
_bf16_widens = _bf16_packing and _intel and not _amx   # many-row bfloat16 products: `_widens`


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` of bfloat16 tensors computed in float32 and rounded once to bfloat16: the weight is widened
    `WIDEN_ELEMENTS` at a time (a large vocabulary's head would otherwise be copied whole) and multiplied by MKL's
    float32 kernels."""
    x32 = x.float()
    outputs, inputs = weight.shape
    step = max(1, WIDEN_ELEMENTS // max(1, inputs))
    if step >= outputs:
        return F.linear(x32, weight.float(), None if bias is None else bias.float()).to(x.dtype)
    out = torch.empty((*x.shape[:-1], outputs), dtype=x.dtype)
    for start in range(0, outputs, step):
        end = min(outputs, start + step)
        part_bias = None if bias is None else bias[start:end].float()
        out[..., start:end] = F.linear(x32, weight[start:end].float(), part_bias)
    return out


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` of a [T, K] bfloat16 `x` by a bfloat16 weight on a CPU without bfloat16 units, where torch's own
    bfloat16 products are emulated: 5-7x slower than float32 from 8 rows up on the AVX2 guest, and as slow per row
    at any count (a 4,096 x 768 weight by 256 rows: 193 ms against 29 ms in float32). A few rows go through the
    bfloat16 few-rows kernel (it reads the weight in bfloat16: half the bytes of float32), more are widened to
    float32 (`widened_linear`: 36 ms for the same product); one row by a small weight stays with torch, whose call
    costs less. Both sum in float32 and round once, as torch's bfloat16 products do."""
    rows = x.shape[0]
    large = weight.numel() >= FEW_ROWS_MIN_WEIGHT
    if rows == 1 and not large:
        return F.linear(x, weight, bias)
    if rows <= (BF16_FEW_ROWS_MAX if large else BF16_FEW_ROWS_MAX_SMALL_WEIGHT) and weight.is_contiguous():
        return few_rows_linear_bf16(x, weight, bias)
    return widened_linear(x, weight, bias)


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` itself, except in bfloat16: on a CPU without bfloat16 units through `bf16_linear`, on one with them
    through the packed weight (packed.py), float32 too where its products pack, one row by a large weight through
    the one-row kernel where `own_loops_pay`. The products that stay with MKL in float32 elsewhere (the router, the
    experts outside the fused kernel, the decode-only attention output, the head)."""
    if _emulated_bf16(x, weight):
        return bf16_linear(x, weight, bias)
    if _one_row(x, weight, bias):
        return one_row_linear(x, weight, bias)
    if _small_bf16_rows(x, weight):
        return few_rows_linear_bf16(x, weight, bias)
    if _widens(x, weight):
        return _widened(x, weight, bias)
    if _packs(x, weight):
        return packed_linear(x, weight, bias, _tiny_work[x.dtype])
    return F.linear(x, weight, bias)


def _emulated_bf16(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (not _bf16_units and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.dim() == 2
            and x.shape[0] > 0)


def _widened(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A product `_widens` takes: by a weight of fewer than ONE_ROW_MIN_WEIGHT elements through its float32 copy, kept
    (no conversion a call: small-vllm's decode steps at 16 / 32 rows 0.88 / 0.90 of the time, its prefill alike); by a
    larger one widened a piece at a time, call by call (a kept copy would double its bytes)."""
    if weight.numel() < ONE_ROW_MIN_WEIGHT:
        return kept_wide_linear(x, weight, bias)
    return widened_linear(x, weight, bias)


def _widens(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a bfloat16 product of this many rows computes faster widened to float32 here (WIDEN_ROWS_MIN)."""
    return (_bf16_widens and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.dim() == 2
            and weight.dim() == 2
            and x.shape[0] >= (WIDEN_ROWS_MIN if weight.numel() >= ONE_ROW_MIN_WEIGHT else WIDEN_ROWS_MIN_SMALL_WEIGHT))


def _packs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (packs_products(x.dtype) and weight.dtype == x.dtype and x.dim() == 2 and weight.dim() == 2
            and x.shape[0] > 0)


def packs_products(dtype: torch.dtype) -> bool:
    """Whether products of `dtype` run through packed weights here (bfloat16 on a CPU with bfloat16 units, float32
    on one with AVX-512 whose MKL runs generic code)."""
    return (_bf16_packing and dtype == torch.bfloat16) or (_f32_packing and dtype == torch.float32)


def products_on_tiles(dtype: torch.dtype) -> bool:
    """Whether products of `dtype` run packed on this CPU's matrix tiles (bfloat16 with AMX)."""
    return dtype == torch.bfloat16 and _bf16_packing and _amx


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a [T, K] `x`: bfloat16 on a CPU without bfloat16 units through `bf16_linear`;
    one row by a large weight where `own_loops_pay` through the one-row kernel; elsewhere a float32
    product of 2..FEW_ROWS_MAX rows (on Intel's MKL from FEW_ROWS_MIN_INTEL) by a large weight through the
    few-rows kernel; a product whose dtype packs here
    through the packed weight; a float32 one of a multiple of ONEDNN_ROWS rows through oneDNN; else MKL."""
    if _emulated_bf16(x, weight):
        return bf16_linear(x, weight, bias)
    if _one_row(x, weight, bias):
        return one_row_linear(x, weight, bias)
    if _few_rows(x, weight, bias):
        return few_rows_linear(x, weight, bias)
    if _small_bf16_rows(x, weight):
        return few_rows_linear_bf16(x, weight, bias)
    if _widens(x, weight):
        return _widened(x, weight, bias)
    if _packs(x, weight):
        return packed_linear(x, weight, bias, _tiny_work[x.dtype])
    if (x.shape[0] % ONEDNN_ROWS or not x.shape[0] or _onednn is None or x.dim() != 2 or x.dtype != torch.float32
            or weight.dtype != torch.float32 or not (x.is_contiguous() and weight.is_contiguous())):
        return F.linear(x, weight, bias)
    return _onednn(x, weight, bias, "none", [], "")


def own_loops_pay(dtype: torch.dtype) -> bool:
    """Whether our compiled loops take some of a `dtype`'s products from the library's (one row by a large weight,
    and in bfloat16 a few rows by a small one): float32's where MKL runs its generic code (with or without packs: on
    the AMD EPYC with AVX2, one thread, granite-350m's decode step at batch 1 took 0.88 of its time with MKL's
    one-row products, one engine alternating the two); bfloat16's
    where its products pack, but on a CPU with AMX, where a compiled loop of ours read a one-row bfloat16 product at
    7-8 GB/s against the packed product's 10-12.5 (the Xeon with AMX in benchmarks/README.md); the bfloat16 loops
    were measured faster on the EPYC with AVX512-BF16 only."""
    if dtype == torch.float32:
        return _f32_own_loops
    return packs_products(dtype) and not (dtype == torch.bfloat16 and _amx)


def _one_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    bf16 = x.dtype == torch.bfloat16
    return (x.dim() == 2 and x.shape[0] == 1 and own_loops_pay(x.dtype) and weight.dtype == x.dtype
            and weight.dim() == 2 and weight.is_contiguous()
            and weight.numel() >= (ONE_ROW_MIN_WEIGHT_BF16 if bf16 else ONE_ROW_MIN_WEIGHT)
            and not (bf16 and _intel and weight.numel() >= ONE_ROW_MAX_WEIGHT_BF16_INTEL)
            and (bias is None or bias.dtype == x.dtype))


def _small_bf16_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype == torch.bfloat16 and own_loops_pay(x.dtype) and weight.dtype == torch.bfloat16
            and x.dim() == 2 and 2 <= x.shape[0] <= SMALL_BF16_ROWS_MAX and weight.dim() == 2
            and weight.numel() < SMALL_BF16_WEIGHT_BELOW and weight.is_contiguous())


def _few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    fewest = 2 if _f32_own_loops else FEW_ROWS_MIN_INTEL
    return (not _f32_packing and fewest <= x.shape[0] <= FEW_ROWS_MAX and x.dim() == 2
            and weight.numel() >= FEW_ROWS_MIN_WEIGHT
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.is_contiguous()
            and weight.is_contiguous() and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())))
