"""Products through oneDNN's packed weight: the row buckets; bfloat16 (a CPU with bfloat16 units) agreeing with
`F.linear` summed in float32 and rounded once, float32 (a CPU whose MKL runs generic code) agreeing with `F.linear`;
a pack per view of a weight, a new pack after an in-place write; `linear` / `plain_linear` sending every bfloat16
product there, and float32 ones only where float32 packs pay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridpd.engine.model.kernels import linear as linear_module
from hybridpd.engine.model.kernels.packed import (
    CHUNK_ROWS, EXACT_ROWS_MAX, OWN_PACK_ATTRIBUTES, PACKS_ATTRIBUTE, SMALL_ROWS_MAX, TINY_WORK, bucketed_rows,
    float32_packs_pay, mkl_runs_generic, packed_linear, packing_works, row_bucket, row_pieces, tiny_work,
)

BF16 = torch.bfloat16
needs_packing = pytest.mark.skipif(not packing_works(), reason="this CPU or torch build packs no bfloat16 weights")
needs_float32_packing = pytest.mark.skipif(not packing_works(torch.float32),
                                           reason="this torch build packs no float32 weights")


@pytest.mark.parametrize("rows, bucket", [
    (1, 1), (7, 7), (16, 16), (17, 24), (24, 24), (25, 32), (63, 64), (64, 64), (65, 128), (128, 128), (200, 256),
    (256, 256),
])
def test_row_buckets(rows, bucket):
    assert row_bucket(rows) == bucket


@pytest.mark.parametrize("rows", [0, CHUNK_ROWS + 1])
def test_a_bucket_holds_at_most_a_chunk(rows):
    with pytest.raises(ValueError, match="a bucket holds"):
        row_bucket(rows)


@needs_float32_packing
def test_a_bounded_number_of_row_counts_reach_onednn(monkeypatch):
    """Every step size up to 4,096 rows meets at most 25 row counts per weight: chunks of CHUNK_ROWS, the last one in
    its bucket (each bucket within 64 rows of what it holds). In float32, which any oneDNN build packs (the buckets
    are the same for both dtypes)."""
    seen: list[int] = []
    multiply = torch.ops.mkldnn._linear_pointwise

    class Recording:
        _reorder_linear_weight = torch.ops.mkldnn._reorder_linear_weight

        def _linear_pointwise(self, x, *rest):
            seen.append(x.shape[0])
            return multiply(x, *rest)

    monkeypatch.setattr(torch.ops, "mkldnn", Recording())
    weight = _weight(TINY_WORK // 64, 64).float()    # every product of 2 rows or more through the pack
    for rows in (*range(2, 300), 511, 512, 513, 1000, 2048, 4096):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(packed_linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert len(set(seen)) <= EXACT_ROWS_MAX + (SMALL_ROWS_MAX - EXACT_ROWS_MAX) // 8 + (CHUNK_ROWS - SMALL_ROWS_MAX) // 64
    assert max(seen) == CHUNK_ROWS


@pytest.mark.parametrize("rows, weight_elements, pieces", [
    (200, 2**21, [(0, 192), (192, 200)]),             # 56 rows of padding by a large weight: two calls
    (200, 2**10, [(0, 200)]),                         # by a small one the padding costs less than a call
    (250, 2**22, [(0, 250)]),                         # 6 rows of padding, under a sixteenth of the rows
    (72, 2**20, [(0, 64), (64, 72)]),
    (65, 2**20, [(0, 64), (64, 65)]),
    (64, 2**24, [(0, 64)]),                           # buckets of 8 up to 64 rows: little padding
    (17, 2**24, [(0, 17)]),                           # 7 rows of padding, but nothing to split at below 64
    (57, 2**24, [(0, 57)]),
    (600, 2**21, [(0, 256), (256, 512), (512, 576), (576, 600)]),   # chunks, then the last one split
    (512, 2**21, [(0, 256), (256, 512)]),
])
def test_row_pieces(rows, weight_elements, pieces):
    assert row_pieces(rows, weight_elements) == pieces
    assert {row_bucket(end - start) for start, end in pieces} <= {row_bucket(n) for n in range(1, CHUNK_ROWS + 1)}


@pytest.mark.parametrize("rows, bucketed", [
    (208, 256),     # a step's rows rounded up to their bucket
    (200, 256),
    (12, 12),       # exact up to 16 rows
    (20, 24),
    (256, 256),
    (272, 272),     # a chunk and 16 rows
    (300, 304),     # a chunk and 44 rows in a bucket of 48
])
def test_bucketed_rows(rows, bucketed):
    assert bucketed_rows(rows) == bucketed
    pieces = row_pieces(bucketed, 2**26)   # the bucketed rows by the largest weight: whole buckets, nothing split
    assert sum(row_bucket(end - start) for start, end in pieces) == bucketed


@needs_packing
@pytest.mark.parametrize("rows, split", [(17, False), (57, False), (72, True), (200, True), (600, True)])
def test_a_large_weights_pieces_agree_with_f_linear(rows, split):
    weight = _weight(4096, 1024)   # 2^22 elements: enough padding to split from 4 rows of it
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows)).to(BF16)
    assert (len(row_pieces(rows, weight.numel())) > (rows - 1) // CHUNK_ROWS + 1) is split
    _assert_rounds_alike(packed_linear(x, weight), _reference(x, weight, None))


def _weight(outputs: int, inputs: int, seed: int = 0) -> torch.nn.Parameter:
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter((torch.randn(outputs, inputs, generator=gen) / inputs ** 0.5).to(BF16),
                              requires_grad=False)


def _reference(x, weight, bias):
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(BF16)


def _assert_rounds_alike(got, want):
    assert got.dtype == BF16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)


@needs_packing
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 40, 64, 65, 200])
@pytest.mark.parametrize("part", ["whole", "first rows", "last rows"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_agrees_with_f_linear_rounded_once(rows, part, with_bias):
    weight = _weight(640, 80)   # from 11 rows (the whole) or 22 (a part) through oneDNN, below through the copy
    view = {"whole": weight, "first rows": weight[:300], "last rows": weight[300:]}[part]
    x = torch.randn(rows, 80, generator=torch.Generator().manual_seed(rows)).to(BF16)
    bias = torch.randn(view.shape[0]).to(BF16) if with_bias else None
    _assert_rounds_alike(packed_linear(x, view, bias), _reference(x, view, bias))


@needs_packing
def test_each_view_of_a_weight_has_its_own_pack_made_once():
    weight = _weight(64, 32)
    x = torch.randn(3, 32).to(BF16)
    for _ in range(3):
        packed_linear(x, weight)
        packed_linear(x, weight[:16])
        packed_linear(x, weight[16:])
    assert len(getattr(weight, PACKS_ATTRIBUTE)) == 3


@needs_packing
def test_a_pack_is_kept_on_the_tensor_it_was_made_for_and_dropped_when_written():
    weight = _weight(640, 80)
    view = weight[300:]
    x = torch.randn(40, 80).to(BF16)   # 40 x 340 x 80 elements: through oneDNN's pack, not the copy
    packed_linear(x, view)
    kept = getattr(view, OWN_PACK_ATTRIBUTES[False])
    assert [kept] == [p for key, p in getattr(weight, PACKS_ATTRIBUTE).items() if key[1] == view.data_ptr()]
    packed_linear(x, view)
    assert getattr(view, OWN_PACK_ATTRIBUTES[False]) is kept                 # found, not made again
    weight.mul_(2)                                                            # the base written: the view is stale
    _assert_rounds_alike(packed_linear(x, view), _reference(x, view, None))
    assert getattr(view, OWN_PACK_ATTRIBUTES[False]) is not kept


@needs_packing
@pytest.mark.parametrize("elements, rows, widened", [
    (64 * 32, 1, True), (64 * 32, 64, True), (TINY_WORK // 16, 16, True), (TINY_WORK // 16, 17, False),
    (TINY_WORK + 32, 1, False),
])
def test_a_small_weights_few_rows_multiply_its_float32_copy(elements, rows, widened):
    weight = _weight(elements // 32, 32)
    x = torch.randn(rows, 32).to(BF16)
    _assert_rounds_alike(packed_linear(x, weight), _reference(x, weight, None))
    (kind, *_), = getattr(weight, PACKS_ATTRIBUTE)
    assert kind is widened


@pytest.mark.parametrize("dtype, vendor, limit", [
    (BF16, "AuthenticAMD", TINY_WORK // 2), (BF16, "HygonGenuine", TINY_WORK // 2), (BF16, "GenuineIntel", TINY_WORK),
    (BF16, "", TINY_WORK), (torch.float32, "AuthenticAMD", TINY_WORK), (torch.float32, "GenuineIntel", TINY_WORK),
])
def test_bfloat16s_small_products_pack_from_half_the_work_where_mkl_runs_generic_code(dtype, vendor, limit):
    assert tiny_work(dtype, vendor) == limit


@needs_packing
@pytest.mark.parametrize("rows, widened", [(8, True), (9, False)])
def test_the_limit_handed_to_a_product_decides_its_path(rows, widened):
    weight = _weight(TINY_WORK // 16 // 32, 32)   # 8 rows: TINY_WORK // 2 rows x elements
    x = torch.randn(rows, 32).to(BF16)
    _assert_rounds_alike(packed_linear(x, weight, tiny=TINY_WORK // 2), _reference(x, weight, None))
    (kind, *_), = getattr(weight, PACKS_ATTRIBUTE)
    assert kind is widened


@needs_packing
@pytest.mark.parametrize("rows, outputs", [(2, 64), (64, 1024)])   # the float32 copy, oneDNN's pack
def test_a_weight_written_in_place_is_packed_again(rows, outputs):
    weight = _weight(outputs, 32)
    x = torch.randn(rows, 32).to(BF16)
    packed_linear(x, weight)
    with torch.no_grad():
        weight.mul_(-3)
    _assert_rounds_alike(packed_linear(x, weight), _reference(x, weight, None))


@pytest.fixture
def packed_rows(monkeypatch) -> list[int]:
    """The row counts `linear` / `plain_linear` hand the packed product (which still computes them)."""
    taken: list[int] = []

    def record(x, weight, bias=None, tiny=TINY_WORK):
        taken.append(x.shape[0])
        return packed_linear(x, weight, bias, tiny)

    monkeypatch.setattr(linear_module, "packed_linear", record)
    return taken


@needs_packing
@pytest.mark.parametrize("product", [linear_module.linear, linear_module.plain_linear])
@pytest.mark.parametrize("rows", [1, linear_module.SMALL_BF16_ROWS_MAX + 1, 64, 65, 300])
def test_bfloat16_products_take_the_pack(monkeypatch, packed_rows, product, rows):
    """But one row by a large weight and a few rows by a small one (test_few_rows.py), and many rows where they
    are widened (below)."""
    monkeypatch.setattr(linear_module, "_bf16_units", True)
    monkeypatch.setattr(linear_module, "_bf16_widens", False)
    weight, x = _weight(48, 32), torch.randn(rows, 32).to(BF16)
    _assert_rounds_alike(product(x, weight), _reference(x, weight, None))
    assert packed_rows == [rows]


LARGE_WEIGHT = (linear_module.ONE_ROW_MIN_WEIGHT // 64, 64)
SMALL_WEIGHT = (48, 32)


@needs_packing
@pytest.mark.parametrize("product", [linear_module.linear, linear_module.plain_linear])
@pytest.mark.parametrize("shape, rows, taken", [
    (LARGE_WEIGHT, linear_module.WIDEN_ROWS_MIN, "widened"),   # widened a piece at a time
    (LARGE_WEIGHT, linear_module.WIDEN_ROWS_MIN - 1, "packed"),
    (LARGE_WEIGHT, 300, "widened"),
    (SMALL_WEIGHT, linear_module.WIDEN_ROWS_MIN_SMALL_WEIGHT, "kept"),   # from fewer rows, through a kept copy
    (SMALL_WEIGHT, linear_module.WIDEN_ROWS_MIN_SMALL_WEIGHT - 1, "packed"),
])
def test_many_rows_of_bfloat16_are_widened_on_intels_cpus_without_amx(monkeypatch, packed_rows, product, shape,
                                                                      rows, taken):
    """There MKL's float32 products outrun oneDNN's bfloat16 ones (linear.py); the result is rounded once, as the
    pack's."""
    monkeypatch.setattr(linear_module, "_bf16_units", True)
    monkeypatch.setattr(linear_module, "_bf16_widens", True)
    monkeypatch.setattr(linear_module, "_amx", False)
    calls = []
    for name, kind in (("widened_linear", "widened"), ("kept_wide_linear", "kept")):
        monkeypatch.setattr(linear_module, name, lambda x, w, b=None, real=getattr(linear_module, name), kind=kind:
                            calls.append((kind, x.shape[0])) or real(x, w, b))
    weight, x = _weight(*shape), torch.randn(rows, shape[1]).to(BF16)
    _assert_rounds_alike(product(x, weight), _reference(x, weight, None))
    calls += [("packed", n) for n in packed_rows]
    assert calls == [(taken, rows)]


@pytest.mark.parametrize("product", [linear_module.linear, linear_module.plain_linear])
def test_float32_where_mkl_is_intels_and_cpus_without_units_never_pack(monkeypatch, product):
    monkeypatch.setattr(linear_module, "packed_linear", lambda *a: pytest.fail("packed a product"))
    monkeypatch.setattr(linear_module, "_f32_packing", False)
    weight = torch.randn(48, 32)
    product(torch.randn(4, 32), weight)
    monkeypatch.setattr(linear_module, "_bf16_units", False)
    monkeypatch.setattr(linear_module, "_bf16_packing", False)
    product(torch.randn(4, 32).to(BF16), weight.to(BF16))




@pytest.mark.parametrize("vendor, flags, generic, pays", [
    ("GenuineIntel", {"avx2", "avx512f"}, False, False),   # MKL's own kernels
    ("AuthenticAMD", {"avx2", "avx512f"}, True, True),     # oneDNN runs AVX-512, MKL's generic code does not
    ("AuthenticAMD", {"avx2", "fma"}, True, False),        # both run AVX2: the pack's call costs more
    ("HygonGenuine", {"avx2", "avx512f"}, True, True),
    ("", {"avx512f"}, False, False),                       # no maker known: MKL
])
def test_float32_packs_where_mkl_runs_generic_code_without_avx512(vendor, flags, generic, pays):
    assert mkl_runs_generic(vendor) is generic
    assert float32_packs_pay(vendor, frozenset(flags)) is pays


@needs_float32_packing
@pytest.mark.parametrize("rows", [1, 2, 16, 17, 65, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_agrees_with_f_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(640, 80, generator=gen) / 80 ** 0.5   # through oneDNN from 11 rows, below through MKL
    x = torch.randn(rows, 80, generator=gen)
    bias = torch.randn(640, generator=gen) if with_bias else None
    out = packed_linear(x, weight, bias)
    assert out.dtype == torch.float32 and out.shape == (rows, 640)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert bool(getattr(weight, PACKS_ATTRIBUTE, None)) is (rows * weight.numel() > TINY_WORK)


@needs_float32_packing
@pytest.mark.parametrize("product", [linear_module.linear, linear_module.plain_linear])
@pytest.mark.parametrize("rows", [1, 8, 64, 300])
def test_float32_products_take_the_pack_where_it_pays(monkeypatch, packed_rows, product, rows):
    monkeypatch.setattr(linear_module, "_f32_packing", True)
    weight, x = torch.randn(48, 32), torch.randn(rows, 32)
    torch.testing.assert_close(product(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert packed_rows == [rows]
