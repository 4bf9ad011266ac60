"""A prefill's causal attention over many keys as oneDNN products, on CPUs with AVX-512 where MKL runs its generic
code.

torch's CPU SDPA (its flash kernel) multiplies its blocks through MKL: bfloat16 through `cblas_gemm_bf16bf16f32`,
float32 through sgemm. On a CPU that is not Intel's MKL runs its generic code there, and on one with AVX-512
(`linear.packs_products(torch.float32)`) a prefill's attention was the largest part of small-vllm's prefill (head
size 32: its products are thin, and MKL's generic bfloat16 product widens both sides to float32 first). oneDNN runs
the same products in the CPU's own instructions. On an AVX2 CPU both run AVX2 and SDPA was the faster (the AMD EPYC
with AVX2 in benchmarks/README.md: small-vllm's 1,024-token prefill 1.09x as long through these products, the
granite-350m preset's 512-token one 0.98x).

Here, per KV head and per block of BLOCK query rows (the query heads sharing the KV head stacked in one product), the
scores are one float32 product through oneDNN (`torch.ops.mkldnn._linear_pointwise`; bfloat16 queries and keys widened
first, so the products are exact and summed in float32, as SDPA's are), over only the keys the block's last row sees;
one compiled pass over the scores leaves each row's softmax over the keys it sees and 0 over the block's later keys
(torch's softmax and the mask took four passes: 42% of the attention's time on small-vllm's heads, where the products
are thin). In float32 the weights stay unnormalised (`_causal_exp_rows`) and the product with the values is divided
by each row's sum. In bfloat16 (`_causal_softmax_rows_bf16`) the weights are normalised and rounded to bfloat16, and
their product with the bfloat16 values runs in bfloat16 (summed in float32, rounded once): transformers' bfloat16
attention rounds the same weights, and oneDNN's bfloat16 product here takes ~0.55 of the float32 one's time (480 x
1,024 weights by 1,024 x 32 values: 80 against 144 us); the attention of a 240-row chunk after 784 keys 0.89 of its
time with the float32 product, a 1,024-token prompt 0.88. Its error against a float64 reference is then that of
transformers' bfloat16 attention, up to ~1.7x SDPA's (SDPA rounds the weights before normalising them and divides in
float32). Measured on the EPYC with AVX512-BF16 (benchmarks/README.md), one thread, against SDPA in the same run, with
the float32 product of the weights: bfloat16, small-vllm's heads (4 query / 2 KV heads of 32), a 1,024-token prompt
2.9 against 5.1 ms, 192 rows after 832 keys 0.82 against 1.59 (3.1 / 0.92 before the one-pass softmax); granite-350m's
(12 / 4 of 64) 14.3 against 27.0 ms; float32 3.4 against 4.9 and 14.4 against 26.0.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from hybridpd.engine.model.kernels.bf16_bits import narrow
from hybridpd.engine.model.kernels.linear import packs_products
from hybridpd.engine.model.kernels.row_max import highest
from hybridpd.engine.model.kernels.silu import exp32

BLOCK = 256   # query rows per product, at most
SCORES_MAX = 1 << 22   # float32 scores per product, at most (16 MiB): a block takes fewer rows over many keys
# The most keys taken here (more go to SDPA, which streams over them): measured to 8,192 (256 rows after 7,936 keys
# 10.5 against 18.4 ms, a 4,096-token prompt 41 against 63).
MAX_KEYS = 1 << 14
# The least query rows x keys of a sequence taken here: below it SDPA's fixed costs are smaller (same runs, bfloat16,
# small-vllm's heads: 64 rows after 192 keys 0.19 against 0.18 ms, a 128-token prompt 0.19 against 0.20 through SDPA's
# query chunks; a 192-token one 0.29 against 0.35, 48 rows after 704 keys 0.29 against 0.35).
MIN_WORK = 1 << 15
# The same for each of several fresh prompts of one length, which SDPA takes in one call per query chunk: 8 x 256
# tokens 3.5 against 2.9 ms here, 4 x 384 2.9 against 3.1, 4 x 512 4.1 against 5.2.
BATCHED_MIN_WORK = 1 << 18


def products_pay(dtype: torch.dtype) -> bool:
    """Whether a `dtype` model's prefill attention goes through these products on this CPU: where float32's
    products go through oneDNN's packs (MKL runs generic code), and for bfloat16 where the CPU has bfloat16 units
    (its weights-by-values product is bfloat16's: oneDNN has no bfloat16 product on a CPU without them, so there
    SDPA takes it)."""
    return packs_products(torch.float32) and (
        dtype == torch.float32 or (dtype == torch.bfloat16 and packs_products(torch.bfloat16)))


def takes(dtype: torch.dtype, rows: int, keys: int, sequences: int = 1) -> bool:
    """Whether `sequences` sequences of `rows` query rows over `keys` keys each, of a `dtype` model, attend here."""
    return (rows * keys >= (MIN_WORK if sequences == 1 else BATCHED_MIN_WORK) and keys <= MAX_KEYS
            and products_pay(dtype))


@numba.njit(inline="always", fastmath=True, boundscheck=False)
def _exp_from_highest(row, n):  # pragma: no cover - compiled
    """row[:n] -> exp(row[j] - the highest of them), in place; returns their sum."""
    top = highest(row, 0, n)
    total = np.float32(0.0)
    for j in range(n):
        e = exp32(row[j] - top)
        row[j] = e
        total += e
    return total


@numba.njit(numba.void(numba.float32[:, ::1], numba.int64, numba.float32[::1]), cache=True, nogil=True,
            fastmath=True, boundscheck=False, error_model="numpy")
def _causal_exp_rows(scores, rows, inverse):  # pragma: no cover - compiled
    """In place, each row of a block's scores [heads x rows, seen] (row r of each head seeing keys 0 ..
    seen - rows + r) -> exp(score - the highest score it sees) over the keys it sees, 0 over the rest; `inverse`
    gets 1 / the row's sum. Two passes over a row (its highest, then exp) where torch's softmax took three and the
    causal mask a fourth."""
    seen = scores.shape[1]
    common = seen - rows
    for i in range(scores.shape[0]):
        row = scores[i]
        n = common + i % rows + 1
        total = _exp_from_highest(row, n)
        for j in range(n, seen):
            row[j] = np.float32(0.0)
        inverse[i] = np.float32(1.0) / total


@numba.njit(numba.void(numba.float32[:, ::1], numba.int64, numba.uint16[:, ::1]), cache=True, nogil=True,
            fastmath=True, boundscheck=False, error_model="numpy")
def _causal_softmax_rows_bf16(scores, rows, weights):  # pragma: no cover - compiled
    """As `_causal_exp_rows`, but each row's softmax normalised and rounded to bfloat16 into `weights` (its bits):
    the weights a bfloat16 product with the values takes, rounded once, as transformers' bfloat16 attention rounds
    them. `scores` is left holding the unnormalised weights."""
    seen = scores.shape[1]
    common = seen - rows
    for i in range(scores.shape[0]):
        row, out = scores[i], weights[i]
        n = common + i % rows + 1
        total = _exp_from_highest(row, n)
        inverse = np.float32(1.0) / total
        for j in range(n):
            out[j] = narrow(row[j] * inverse, out)
        for j in range(n, seen):
            out[j] = 0


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, first: int,
                     scale: float) -> None:
    """Causal attention of `q` [n, Hq, D] over `k`, `v` [m, Hkv, D] (any strides; Hq a multiple of Hkv, the query
    heads of KV head j being j * Hq / Hkv onwards) into `out` [n, Hq, D]: query row i sees keys 0 .. first + i,
    which must all exist (first + n <= m). Float32 or bfloat16, all four tensors of one dtype."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_heads % num_kv_heads or first < 0 or first + n > k.shape[0]:
        raise ValueError(f"{num_heads} query heads over {num_kv_heads} KV heads, rows {first}..{first + n} of "
                         f"{k.shape[0]} keys")
    group = num_heads // num_kv_heads
    last = first + n                       # keys any row sees
    block = max(1, min(BLOCK, n, SCORES_MAX // (group * last)))
    product = torch.ops.mkldnn._linear_pointwise
    low = q.dtype == torch.bfloat16   # the weights and values multiplied in bfloat16
    bf16_products = packs_products(torch.bfloat16)
    for j in range(num_kv_heads):
        heads = slice(j * group, (j + 1) * group)
        keys = torch.empty(last, head_dim, dtype=torch.float32).copy_(k[:last, j])
        values = torch.empty(head_dim, last, dtype=v.dtype).copy_(v[:last, j].t())
        for start in range(0, n, block):
            end = min(n, start + block)
            rows, seen = end - start, first + end
            queries = torch.empty(group, rows, head_dim, dtype=torch.float32)
            queries.copy_(q[start:end, heads].transpose(0, 1)).mul_(scale)
            weights = product(queries.view(group * rows, head_dim), keys[:seen], None, "none", [], "")
            part = values if seen == last else values[:, :seen].contiguous()
            if low:
                rounded = torch.empty(weights.shape, dtype=torch.bfloat16)
                _causal_softmax_rows_bf16(weights.numpy(), rows, rounded.view(torch.uint16).numpy())
                # without bfloat16 units oneDNN has no bfloat16 product: the same one widened (exact), summed in
                # float32 and rounded once where it is stored, as the bfloat16 product's is
                result = (product(rounded, part, None, "none", [], "") if bf16_products
                          else product(rounded.float(), part.float(), None, "none", [], ""))
            else:
                inverse = torch.empty(group * rows, dtype=torch.float32)
                _causal_exp_rows(weights.numpy(), rows, inverse.numpy())
                result = product(weights, part, None, "none", [], "").mul_(inverse.unsqueeze(1))
            out[start:end, heads] = result.view(group, rows, head_dim).transpose(0, 1)
