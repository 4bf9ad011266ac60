"""The few-rows kernel: it agrees with `F.linear` to float32 rounding, a row's result does not depend on the rows
beside it, and `linear` sends it only what it is for (2..FEW_ROWS_MAX float32 contiguous rows, a large weight, where
float32 products do not pack); the one-row kernel agrees too (in bfloat16: test_bf16_linear.py), and takes one row by
a large weight where the row's dtype packs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridpd.engine.model.kernels import few_rows as few_rows_module
from hybridpd.engine.model.kernels import linear as linear_module
from hybridpd.engine.model.kernels.few_rows import few_rows_linear, one_row_linear
from hybridpd.engine.model.kernels.linear import (FEW_ROWS_MAX, FEW_ROWS_MIN_INTEL, FEW_ROWS_MIN_WEIGHT,
                                                  ONE_ROW_MAX_WEIGHT_BF16_INTEL, ONE_ROW_MIN_WEIGHT,
                                                  ONE_ROW_MIN_WEIGHT_BF16,
                                                  SMALL_BF16_ROWS_MAX, SMALL_BF16_WEIGHT_BELOW, linear, plain_linear)
from tests.unit.engine.model.kernels.linear_cases import check_agrees_with_f_linear


@pytest.fixture(params=[True, False], ids=["four-columns", "one-column"])
def column_loop(request, monkeypatch):
    """Either loop a float32 weight may take (four columns at a time with AVX-512, one without), on any CPU."""
    monkeypatch.setattr(few_rows_module, "_FOUR_COLUMNS", request.param)


@pytest.mark.parametrize("rows, inputs, outputs, with_bias", [
    (1, 64, 40, False), (2, 64, 40, True), (3, 7, 5, False), (4, 128, 33, True), (5, 256, 64, False),
    (8, 768, 130, True), (13, 96, 17, False), (6, 40, 3, True),
])
def test_agrees_with_f_linear(column_loop, rows, inputs, outputs, with_bias):
    check_agrees_with_f_linear(few_rows_linear, rows, inputs, outputs, with_bias)


@pytest.mark.parametrize("inputs, outputs, with_bias", [(64, 40, False), (7, 5, True), (768, 130, True)])
def test_one_row_agrees_with_f_linear(inputs, outputs, with_bias):
    check_agrees_with_f_linear(one_row_linear, 1, inputs, outputs, with_bias)


def test_the_one_row_kernel_takes_one_row_of_the_weights_dtype():
    with pytest.raises(ValueError, match="not one row"):
        one_row_linear(torch.zeros(2, 8), torch.zeros(3, 8))
    with pytest.raises(ValueError, match="bfloat16"):
        one_row_linear(torch.zeros(1, 8), torch.zeros(3, 8, dtype=torch.bfloat16))


def test_a_rows_result_does_not_depend_on_the_rows_beside_it(column_loop):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 200, generator=gen)
    weight = torch.randn(26, 200, generator=gen)   # six blocks of four columns and two columns alone
    alone = torch.cat([few_rows_linear(x[i : i + 1].contiguous(), weight) for i in range(8)])
    for rows in range(2, 9):
        for start in range(0, 8 - rows + 1):
            batch = few_rows_linear(x[start : start + rows].contiguous(), weight)
            assert torch.equal(batch, alone[start : start + rows]), (rows, start)
    reversed_rows = few_rows_linear(x.flip(0).contiguous(), weight)
    assert torch.equal(reversed_rows.flip(0), alone)


@pytest.fixture
def kernel_calls(monkeypatch):
    """(kernel, rows) of each call `linear` hands a kernel ("few" or "one"; each still computes it)."""
    calls: list[tuple[str, int]] = []

    def recorder(name):
        def record(x, weight, bias=None):
            calls.append((name, x.shape[0]))
            return F.linear(x, weight, bias)
        return record

    monkeypatch.setattr(linear_module, "few_rows_linear", recorder("few"))
    monkeypatch.setattr(linear_module, "few_rows_linear_bf16", recorder("few_bf16"))
    monkeypatch.setattr(linear_module, "one_row_linear", recorder("one"))
    monkeypatch.setattr(linear_module, "packed_linear", lambda x, weight, bias=None, tiny=0: F.linear(x, weight, bias))
    return calls


LARGE = (FEW_ROWS_MIN_WEIGHT // 64, 64)


BF16 = torch.bfloat16
# The CPUs the routing tells apart: MKL's own kernels (Intel's CPUs); MKL's generic code with AVX2 alone (float32
# stays with MKL but for the compiled loops); with AVX-512 and bfloat16 units (every product packed).
INTEL, AVX2, AVX512 = "intel", "amd-avx2", "amd-avx512"
MIDDLE = (ONE_ROW_MIN_WEIGHT // 64, 64)
SMALL = (ONE_ROW_MIN_WEIGHT // 128, 64)
MIDDLE_BF16 = (ONE_ROW_MIN_WEIGHT_BF16 // 64, 64)
SMALL_BF16 = (ONE_ROW_MIN_WEIGHT_BF16 // 128, 64)


@pytest.mark.parametrize("rows, weight_shape, dtype, contiguous, cpu, taken", [
    (FEW_ROWS_MIN_INTEL - 1, LARGE, torch.float32, True, INTEL, None),   # Intel's MKL reads a few rows as fast
    (FEW_ROWS_MIN_INTEL, LARGE, torch.float32, True, INTEL, "few"),
    (FEW_ROWS_MAX, LARGE, torch.float32, True, INTEL, "few"),
    (1, LARGE, torch.float32, True, INTEL, None),                 # one row: MKL is as fast
    (FEW_ROWS_MAX + 1, LARGE, torch.float32, True, INTEL, None),  # MKL catches up
    (4, (LARGE[0] // 2, 64), torch.float32, True, AVX2, None),    # a small weight: the call costs more than it saves
    (4, LARGE, torch.float64, True, AVX2, None),
    (4, LARGE, torch.float32, False, AVX2, None),                 # strided rows
    (1, LARGE, torch.float32, True, AVX2, "one"),      # MKL's generic code without packs: the one-row kernel
    (2, LARGE, torch.float32, True, AVX2, "few"),
    (1, SMALL, torch.float32, True, AVX2, None),
    (1, LARGE, torch.float32, True, AVX512, "one"),     # where products pack: one row reads faster here than packed
    (2, LARGE, torch.float32, True, AVX512, None),      # from two rows the pack
    (1, MIDDLE, torch.float32, True, AVX512, "one"),    # from ONE_ROW_MIN_WEIGHT elements
    (1, SMALL, torch.float32, True, AVX512, None),      # the packed product's call costs less
    (1, LARGE, BF16, True, AVX512, "one"),
    (2, LARGE, BF16, True, AVX512, None),
    (1, MIDDLE, BF16, True, AVX512, "one"),
    (1, SMALL, BF16, True, AVX512, "one"),             # bfloat16's from fewer elements
    (1, MIDDLE_BF16, BF16, True, AVX512, "one"),
    (1, SMALL_BF16, BF16, True, AVX512, None),
])
def test_linear_sends_the_kernel_only_what_it_is_for(monkeypatch, kernel_calls, rows, weight_shape, dtype, contiguous,
                                                     cpu, taken):
    packs = cpu is AVX512
    monkeypatch.setattr(linear_module, "_f32_packing", packs)
    monkeypatch.setattr(linear_module, "_f32_own_loops", cpu is not INTEL)
    monkeypatch.setattr(linear_module, "_bf16_packing", packs)
    monkeypatch.setattr(linear_module, "_bf16_units", packs or linear_module._bf16_units)
    monkeypatch.setattr(linear_module, "_amx", False)
    monkeypatch.setattr(linear_module, "_intel", cpu is INTEL)
    weight = (torch.randn(*weight_shape) / 8).to(dtype)
    x = (torch.randn(rows, 128)[:, :64] if not contiguous else torch.randn(rows, 64)).to(dtype)
    out = linear(x, weight)
    assert kernel_calls == ([(taken, rows)] if taken else [])
    torch.testing.assert_close(out, F.linear(x, weight))


@pytest.mark.parametrize("elements, intel, taken", [
    (ONE_ROW_MAX_WEIGHT_BF16_INTEL, False, [("one", 1)]),
    (ONE_ROW_MAX_WEIGHT_BF16_INTEL, True, []),                 # Intel's: the packed product streams a large weight
    (ONE_ROW_MAX_WEIGHT_BF16_INTEL // 2, True, [("one", 1)]),  # ... and the loop a small one
])
def test_one_row_of_bfloat16_by_a_large_weight_stays_packed_on_intel(monkeypatch, kernel_calls, elements, intel,
                                                                     taken):
    for flag in ("_f32_packing", "_f32_own_loops", "_bf16_packing", "_bf16_units"):
        monkeypatch.setattr(linear_module, flag, True)
    monkeypatch.setattr(linear_module, "_amx", False)
    monkeypatch.setattr(linear_module, "_intel", intel)
    weight, x = (torch.randn(elements // 64, 64) / 8).to(BF16), torch.randn(1, 64).to(BF16)
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight))
    assert kernel_calls == taken


@pytest.mark.parametrize("dtype, amx, taken", [
    (BF16, False, [("one", 1)]),
    (BF16, True, []),                  # AMX's packed product read one row faster than a loop of ours
    (torch.float32, True, [("one", 1)]),
])
def test_one_row_of_bfloat16_stays_packed_where_the_cpu_has_amx(monkeypatch, kernel_calls, dtype, amx, taken):
    for flag in ("_f32_packing", "_f32_own_loops", "_bf16_packing", "_bf16_units"):
        monkeypatch.setattr(linear_module, flag, True)
    monkeypatch.setattr(linear_module, "_amx", amx)
    monkeypatch.setattr(linear_module, "_intel", False)
    weight, x = (torch.randn(*LARGE) / 8).to(dtype), torch.randn(1, LARGE[1]).to(dtype)
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight))
    assert kernel_calls == taken


FEW_BF16 = (SMALL_BF16_WEIGHT_BELOW // 128, 64)   # below the bound


@pytest.mark.parametrize("product", [linear, plain_linear])
@pytest.mark.parametrize("rows, weight_shape, amx, taken", [
    (2, FEW_BF16, False, "few_bf16"),
    (SMALL_BF16_ROWS_MAX, FEW_BF16, False, "few_bf16"),
    (SMALL_BF16_ROWS_MAX + 1, FEW_BF16, False, None),      # the packed product
    (4, (SMALL_BF16_WEIGHT_BELOW // 64, 64), False, None),   # a weight at the bound: the packed product
    (4, FEW_BF16, True, None),                              # not measured with AMX: the packed product
])
def test_a_few_bfloat16_rows_by_a_small_weight_take_the_few_rows_kernel_where_products_pack(
        monkeypatch, kernel_calls, product, rows, weight_shape, amx, taken):
    for flag in ("_bf16_packing", "_bf16_units"):
        monkeypatch.setattr(linear_module, flag, True)
    monkeypatch.setattr(linear_module, "_amx", amx)
    weight, x = (torch.randn(*weight_shape) / 8).to(BF16), torch.randn(rows, weight_shape[1]).to(BF16)
    torch.testing.assert_close(product(x, weight), F.linear(x, weight))
    assert kernel_calls == ([(taken, rows)] if taken else [])


@pytest.mark.parametrize("cpu, taken", [(AVX512, [("one", 1)]), (AVX2, [("one", 1)]), (INTEL, [])])
def test_the_head_and_other_plain_products_take_the_one_row_kernel_where_mkl_runs_generic_code(monkeypatch,
                                                                                              kernel_calls, cpu, taken):
    monkeypatch.setattr(linear_module, "_f32_packing", cpu is AVX512)
    monkeypatch.setattr(linear_module, "_f32_own_loops", cpu is not INTEL)
    weight, x = torch.randn(*LARGE) / 8, torch.randn(1, LARGE[1])
    torch.testing.assert_close(plain_linear(x, weight), F.linear(x, weight))
    assert kernel_calls == taken


@pytest.mark.parametrize("x_shape, weight_shape, bias_shape", [((2, 5), (3, 6), None), ((2, 6), (3, 6), (4,))])
def test_shapes_that_do_not_fit_are_refused_before_the_kernel_reads(x_shape, weight_shape, bias_shape):
    bias = torch.zeros(bias_shape) if bias_shape else None
    with pytest.raises(ValueError, match="do not fit"):
        few_rows_linear(torch.zeros(x_shape), torch.zeros(weight_shape), bias)
