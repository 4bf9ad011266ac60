"""Products through oneDNN with the weight packed once: bfloat16 on a CPU with bfloat16 units, and float32 on a CPU
with AVX-512 whose MKL runs its generic code (not Intel's: `float32_packs_pay`).

There torch's own bfloat16 `F.linear` runs on oneDNN but hands it the weight as stored, which oneDNN reorders into
its blocked layout inside every call: at a decode step's few rows that reorder is most of the product. Measured on
an Intel Xeon with AMX and AVX512-BF16 (benchmarks/README.md), one thread, 60 weights of 4,096 x 768 (377 MB, past
the L3): torch's product read them at 7.9 / 7.0 / 5.8 / 4.3 GB/s at 1 / 8 / 16 / 32 rows, no faster than float32's
at one row (the machine copies at ~10-11 GB/s); with the weight packed beforehand (`_reorder_linear_weight`) and
multiplied by `_linear_pointwise`, 12.3 / 11.8 / 11.1 / 8.6 GB/s.

float32's products go to MKL (`F.linear`), which picks its code by the CPU's maker: on an AMD EPYC with AVX-512
(Zen 5, benchmarks/README.md), one thread, granite-350m's 136 projections took 2.2-3.3x as long through MKL as through
the packed weight from 2 rows up (at 512 rows 2,417 against 1,054 ms, 8 rows 97 against 41), and 1.3x at one row
(where the one-row kernel reads faster still: few_rows.py); MKL read at 5-20 GB/s where the machine reads 40. On
Intel's CPUs MKL's float32 products were measured at the machine's read rate (benchmarks/README.md) and stay.

oneDNN builds (and caches) a primitive, with scratch memory, for every row count it meets, and a process that meets
every count grows without bound: torch's own bfloat16 products over 1,200 random row counts of 65-2,048 (a server's
prefill steps) on granite-350m's four projection shapes grew it by 2.3-2.4 GB and still growing (with or without
the glibc settings of host_memory.py; with oneDNN's cache capped at 8 primitives still 1.3 GB). So every count is
rounded up to a bucket (`row_bucket`: exact up to 16 rows, then multiples of 8 up to 64, then of 64), the padding
rows zeros; the same 1,200 steps in buckets of 64 held the process at +259 MB from the 300th on. A primitive costs
~0.6 MB whatever the weight's shape (measured on the EPYC with AVX-512, float32 and bfloat16 alike), so buckets of
64 up to a step's 2,048 rows still came to ~54 primitives and ~30 MB per weight shape, more with a larger
`--max-num-batched-tokens`. So more than CHUNK_ROWS rows are multiplied CHUNK_ROWS at a time (the last chunk in its
bucket): at most 25 row counts per weight shape whatever the step's size. Past 64 rows the padding costs up to 63
rows' arithmetic, so a large weight's last piece splits at its multiple of 64, the rest in its own (smaller) bucket:
the same row counts (`row_pieces`). The packed products ran at 0.9-1.4x torch's rate there (100-2,048 rows), and a
product of 1,000 or 2,048 rows took 1.02-1.05x as long in chunks of 256 as whole (granite-350m's shapes, the EPYC).

A small product pays oneDNN's fixed cost per call instead, ~20 us on the Xeon (~11 on the EPYC): a 128 x 128
bfloat16 weight at one row took 20 us packed against 10 as a float32 copy through MKL with both conversions, a
776 x 128 one 24 against 17; at 8 rows a 512 x 128 one was even (24 and 24), a 584 x 128 one 29 against 31. So a
product of at most TINY_WORK rows x weight elements multiplies through MKL: a bfloat16 one as a float32 copy of the
weight, the result rounded once to bfloat16 as oneDNN's is, a float32 one as it is (small-vllm's projections at 16
rows took as long either way on the EPYC, at 4 rows 1.7x as long packed). Where MKL runs its generic code (not an
Intel CPU: `float32_packs_pay`) a bfloat16 product's limit is half that, `tiny_work`: on the EPYC with AVX512-BF16,
one thread, at 16 rows a 256 x 128 weight took 11.7 us packed against 15.3 through the float32 copy, a 128 x 256 one
11.6 against 15.6, a 128 x 128 one 10.5 against 9.9, and at 8 rows a 256 x 128 one 10.7 against 10.6 (float32's own
products cross where TINY_WORK puts them: 256 x 128 at 16 rows 13.8 packed against 12.1, at 32 18.1 against 21.3).

The packs live on the weight they come from (an attribute of its base tensor, so a view of a weight, such as the
gate's rows of a fused projection, has its own), made at the first product and made again when the weight was
written in place (its version counter moved): a reloaded weight never multiplies through a stale pack. They cost
the weight's bytes once more (granite-350m: 497 MB of packs for 505 MB of weights in bfloat16; a fused projection is
one product, not two halves, which would need 330 MB more); a granite-350m engine in bfloat16 held 2.7 GB after
serving against 1.9 without packs (measured). The plain weights stay for the compiled kernels and the other paths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

TINY_WORK = 1 << 19
EXACT_ROWS_MAX = 16
ROW_STEP = 8
SMALL_ROWS_MAX = 64
LARGE_ROW_STEP = 64
CHUNK_ROWS = 256   # more rows are multiplied this many at a time
# A piece whose bucket pads at least this many rows x weight elements goes as two (`row_pieces`): on the EPYC with
# AVX512-BF16, one thread, granite-350m's four projection shapes in bfloat16 at 72 / 136 / 200 / 207 rows took 0.60 /
# 0.75 / 0.80 / 0.83 of the padded product's time so (250 rows, 6 padded: 1.02); small-vllm's, whose padding costs
# less than the second call and the copy, 1.05-1.08.
PADDING_SPLIT_WORK = 1 << 24
PACKS_ATTRIBUTE = "_hybridpd_packs"
OWN_PACK_ATTRIBUTES = {False: "_hybridpd_pack", True: "_hybridpd_pack_widened"}   # on the tensor object itself


def row_bucket(rows: int) -> int:
    """The row count a product of `rows` (at most CHUNK_ROWS) rows runs at (the rest zeros)."""
    if not 0 < rows <= CHUNK_ROWS:
        raise ValueError(f"a bucket holds 1 to {CHUNK_ROWS} rows, not {rows}")
    if rows <= EXACT_ROWS_MAX:
        return rows
    step = ROW_STEP if rows <= SMALL_ROWS_MAX else LARGE_ROW_STEP
    return -(-rows // step) * step


def packing_works(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this torch build packs and multiplies a `dtype` weight through oneDNN (bfloat16 needs bfloat16
    units)."""
    if not torch.backends.mkldnn.is_available():
        return False
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    multiply = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if reorder is None or multiply is None:
        return False
    try:
        weight = torch.ones(4, 8, dtype=dtype)
        out = multiply(torch.ones(1, 8, dtype=dtype), reorder(weight, 1), None, "none", [], "")
    except RuntimeError:
        return False
    return out.shape == (1, 4) and bool((out == 8).all())


def mkl_runs_generic(vendor: str) -> bool:
    """Whether MKL runs its generic code on a CPU of this maker (/proc/cpuinfo's `vendor_id`): its own kernels are
    for Intel's CPUs (module docstring). An unknown maker (another OS) counts as Intel's."""
    return vendor not in ("GenuineIntel", "")


def float32_packs_pay(vendor: str, flags: frozenset[str]) -> bool:
    """Whether float32 products should go through packs on a CPU of this maker with these /proc/cpuinfo flags: where
    MKL runs its generic code and the CPU has AVX-512, which oneDNN runs and that generic code does not. On a CPU
    with AVX2 alone both run AVX2, and the pack's call and row buckets cost more than they save: on the AMD EPYC with
    AVX2 (benchmarks/float32_packs.py, one engine, one thread, packs on and off alternated), small-vllm's 1,024-token
    prefill took 1.34x as long with them and its decode step at batch 16 1.29x, granite-350m's 512-token prefill
    1.15x (its decode steps at batch 1 and 8 1.02x: the one-row and few-rows kernels take those rows either way)."""
    return mkl_runs_generic(vendor) and "avx512f" in flags


@dataclass(frozen=True)
class Pack:
    version: int
    packed: torch.Tensor


PackKey = tuple[bool, int, tuple[int, ...], tuple[int, ...]]


def _pack_of(weight: torch.Tensor, widened: bool) -> torch.Tensor:
    """The pack of a 2-D `weight` (a view included): oneDNN's packed copy, or with `widened` (bfloat16) a float32
    copy; made at the first call and again after the weight was written in place. The pack is also kept on the
    tensor object itself (the model passes the same one every step): found there in one lookup, where the base's
    dictionary needs a key of the view's pointer, shape and strides (~1 us, ~1.5% of a small model's decode step)."""
    version = weight._version          # a view shares its base's counter
    kept = getattr(weight, OWN_PACK_ATTRIBUTES[widened], None)
    if kept is not None and kept.version == version:
        return kept.packed
    base = weight if weight._base is None else weight._base
    packs: dict[PackKey, Pack] | None = getattr(base, PACKS_ATTRIBUTE, None)
    if packs is None:
        packs = {}
        setattr(base, PACKS_ATTRIBUTE, packs)
    key = (widened, weight.data_ptr(), tuple(weight.shape), tuple(weight.stride()))
    pack = packs.get(key)
    if pack is None or pack.version != version:
        made = weight.float() if widened else torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ROW_STEP)
        pack = Pack(version, made)
        packs[key] = pack
    setattr(weight, OWN_PACK_ATTRIBUTES[widened], pack)
    return pack.packed


def tiny_work(dtype: torch.dtype, vendor: str) -> int:
    """The most rows x weight elements of a `dtype` product that go through MKL rather than the pack on a CPU of this
    maker (module docstring)."""
    return TINY_WORK // 2 if dtype == torch.bfloat16 and mkl_runs_generic(vendor) else TINY_WORK


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  tiny: int = TINY_WORK) -> torch.Tensor:
    """`F.linear` of a [T, K] `x` (T >= 1) by a 2-D weight of its dtype (bfloat16 or float32), through the weight's
    pack (CHUNK_ROWS rows at a time, the last chunk rounded up to its bucket with zero rows, which are cut off the
    result), or a product of at most `tiny` rows x weight elements through MKL (a bfloat16 weight's float32 copy)."""
    rows = x.shape[0]
    if rows * weight.numel() <= tiny:
        return F.linear(x, weight, bias) if x.dtype == torch.float32 else kept_wide_linear(x, weight, bias)
    pack = _pack_of(weight, widened=False)
    if rows <= CHUNK_ROWS and not _pads_too_much(rows, weight.numel()):   # a decode step's products: one call
        return _bucketed(x, pack, bias)
    pieces = row_pieces(rows, weight.numel())
    out = torch.empty((rows, weight.shape[0]), dtype=x.dtype)
    for start, end in pieces:
        out[start:end] = _bucketed(x[start:end], pack, bias)
    return out


def kept_wide_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` of bfloat16 tensors through the weight's float32 copy, kept beside it (made at the first call):
    MKL's float32 kernels, the result rounded once to bfloat16, as oneDNN's."""
    wide = _pack_of(weight, widened=True)
    return F.linear(x.float(), wide, None if bias is None else bias.float()).to(torch.bfloat16)


def row_pieces(rows: int, weight_elements: int) -> list[tuple[int, int]]:
    """The row ranges a product of `rows` rows by a weight of `weight_elements` goes through the pack in: CHUNK_ROWS
    at a time, and the last piece split at its multiple of LARGE_ROW_STEP when its bucket's padding would cost more
    than a second call and a copy of the result (`_pads_too_much`)."""
    pieces = _chunks(rows)
    start, end = pieces[-1]
    if _pads_too_much(end - start, weight_elements):
        cut = start + (end - start) // LARGE_ROW_STEP * LARGE_ROW_STEP
        pieces[-1:] = [(start, cut), (cut, end)]
    return pieces


def bucketed_rows(rows: int) -> int:
    """`rows` rounded up as the packs' buckets round them, CHUNK_ROWS at a time: the rows a step of `rows` rows
    multiplies a small weight by, and that a large weight multiplies whole (where it would split its last piece
    instead: a step whose prompt fills the bucket makes one call of it, not two)."""
    return sum(row_bucket(end - start) for start, end in _chunks(rows))


def _chunks(rows: int) -> list[tuple[int, int]]:
    """The row ranges of `rows` rows CHUNK_ROWS at a time."""
    return [(start, min(rows, start + CHUNK_ROWS)) for start in range(0, rows, CHUNK_ROWS)]


def _pads_too_much(rows: int, weight_elements: int) -> bool:
    """Whether `rows` rows padded to their bucket multiply more zero rows than a split pays for: past SMALL_ROWS_MAX
    (below it buckets step by 8 rows, and there is no multiple of 64 to split at), at least PADDING_SPLIT_WORK padded
    rows x weight elements, and at least a sixteenth of the rows."""
    if rows <= SMALL_ROWS_MAX:
        return False
    padding = row_bucket(rows) - rows
    return padding * weight_elements >= PADDING_SPLIT_WORK and padding * 16 >= rows


def _bucketed(x: torch.Tensor, pack: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T <= CHUNK_ROWS, K] by a packed weight, T padded with zero rows to its bucket."""
    rows = x.shape[0]
    bucket = row_bucket(rows)
    if bucket != rows:
        padded = x.new_zeros((bucket, x.shape[1]))
        padded[:rows] = x
        x = padded
    out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), pack, bias, "none", [], "")
    return out if bucket == rows else out[:rows]
