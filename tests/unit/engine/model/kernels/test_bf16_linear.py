"""bfloat16 products on a CPU without bfloat16 units: the bfloat16 few-rows kernel and the widened product agree with
`F.linear` summed in float32 and rounded once to bfloat16, a row's result does not depend on the rows beside it,
`bf16_linear` sends each to what it is for, and `linear` / `plain_linear` take that route only where torch would
emulate bfloat16 (on a CPU with the units, oneDNN's products: test_packed.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridpd.engine.model.kernels import linear as linear_module
from hybridpd.engine.model.kernels.few_rows import few_rows_linear_bf16, one_row_linear
from hybridpd.engine.model.kernels.linear import (BF16_FEW_ROWS_MAX, BF16_FEW_ROWS_MAX_SMALL_WEIGHT,
                                                  FEW_ROWS_MIN_WEIGHT, bf16_linear, linear, plain_linear,
                                                  widened_linear)

BF16 = torch.bfloat16


def _case(rows: int, inputs: int, outputs: int, with_bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + rows * 1000 + inputs + outputs)
    x = torch.randn(rows, inputs, generator=gen).to(BF16)
    weight = (torch.randn(outputs, inputs, generator=gen) / inputs ** 0.5).to(BF16)
    bias = torch.randn(outputs, generator=gen).to(BF16) if with_bias else None
    return x, weight, bias


def _reference(x, weight, bias):
    """The product summed in float32 from the bfloat16 values, rounded once."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(BF16)


def _assert_rounds_alike(got, want):
    """Equal up to one bfloat16 step: the float32 sums run in another order, so a sum near a rounding boundary may
    round the other way."""
    assert got.dtype == BF16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("product", [few_rows_linear_bf16, widened_linear])
@pytest.mark.parametrize("rows, inputs, outputs, with_bias", [
    (1, 64, 40, False), (2, 64, 40, True), (3, 7, 5, False), (4, 128, 33, True), (13, 96, 17, False),
    (32, 768, 130, True),
])
def test_agrees_with_f_linear_rounded_once(product, rows, inputs, outputs, with_bias):
    x, weight, bias = _case(rows, inputs, outputs, with_bias)
    _assert_rounds_alike(product(x, weight, bias), _reference(x, weight, bias))


@pytest.mark.parametrize("inputs, outputs, with_bias", [(64, 40, False), (7, 5, True), (768, 130, True)])
def test_one_row_agrees_with_f_linear_rounded_once(inputs, outputs, with_bias):
    x, weight, bias = _case(1, inputs, outputs, with_bias)
    _assert_rounds_alike(one_row_linear(x, weight, bias), _reference(x, weight, bias))


def test_the_kernel_reads_bfloat16_bits_exactly():
    """Weights that are small integers times powers of two: every product and sum is exact in float32, so the
    kernel's result must equal the reference bit for bit (a wrong widening of the bits would not)."""
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randint(-8, 8, (24, 40), generator=gen).float() * 2.0 ** -3).to(BF16)
    x = (torch.randint(-8, 8, (5, 40), generator=gen).float() * 2.0 ** 4).to(BF16)
    assert torch.equal(few_rows_linear_bf16(x, weight), _reference(x, weight, None))
    assert torch.equal(one_row_linear(x[:1], weight), _reference(x[:1], weight, None))


@pytest.mark.parametrize("rows, with_bias", [(1, False), (3, True), (8, False), (13, True)])
def test_rows_read_as_bfloat16_bits_give_the_bits_of_their_float32_copy(rows, with_bias):
    """Contiguous bfloat16 rows are widened inside the kernel and its sums rounded there; strided ones go through a
    float32 copy and torch's rounding of the float32 sums: the same bits."""
    x, weight, bias = _case(rows, 96, 37, with_bias)
    strided = torch.empty(rows, 2 * 96, dtype=BF16)[:, ::2]
    strided.copy_(x)
    assert x.is_contiguous() and not strided.is_contiguous()
    assert torch.equal(few_rows_linear_bf16(x, weight, bias), few_rows_linear_bf16(strided, weight, bias))


def test_the_widened_product_goes_a_slice_of_the_weight_at_a_time(monkeypatch):
    x, weight, bias = _case(6, 48, 100, True)
    whole = widened_linear(x, weight, bias)
    monkeypatch.setattr(linear_module, "WIDEN_ELEMENTS", 48 * 7)   # 7 output rows at a time: 15 slices
    sliced = widened_linear(x, weight, bias)
    _assert_rounds_alike(sliced, whole)
    _assert_rounds_alike(sliced, _reference(x, weight, bias))


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    x, weight, _ = _case(8, 200, 24, False, seed=3)
    alone = torch.cat([few_rows_linear_bf16(x[i : i + 1], weight) for i in range(8)])
    for rows in range(2, 9):
        for start in range(0, 8 - rows + 1):
            assert torch.equal(few_rows_linear_bf16(x[start : start + rows], weight), alone[start : start + rows])


@pytest.fixture
def routes(monkeypatch):
    """Which product each bfloat16 call went to (each still computes it)."""
    taken: list[str] = []

    def recording(name, product):
        def record(x, weight, bias=None):
            taken.append(name)
            return product(x, weight, bias)
        return record

    monkeypatch.setattr(linear_module, "few_rows_linear_bf16", recording("kernel", few_rows_linear_bf16))
    monkeypatch.setattr(linear_module, "widened_linear", recording("widened", widened_linear))
    monkeypatch.setattr(linear_module.F, "linear", recording("torch", F.linear))
    return taken


LARGE = (FEW_ROWS_MIN_WEIGHT // 64, 64)
SMALL = (LARGE[0] // 2, 64)


@pytest.mark.parametrize("rows, weight_shape, contiguous, route", [
    (1, LARGE, True, "kernel"),
    (BF16_FEW_ROWS_MAX, LARGE, True, "kernel"),
    (BF16_FEW_ROWS_MAX + 1, LARGE, True, "widened"),
    (1, SMALL, True, "torch"),                                  # torch's call costs less than the kernel's
    (2, SMALL, True, "kernel"),
    (BF16_FEW_ROWS_MAX_SMALL_WEIGHT, SMALL, True, "kernel"),
    (BF16_FEW_ROWS_MAX_SMALL_WEIGHT + 1, SMALL, True, "widened"),
    (4, LARGE, False, "widened"),                               # the kernel reads a contiguous weight
])
def test_bf16_linear_sends_each_product_where_it_is_cheapest(routes, rows, weight_shape, contiguous, route):
    weight = (torch.randn(weight_shape[0], 2 * weight_shape[1]) / 8).to(BF16)
    weight = weight[:, : weight_shape[1]] if not contiguous else weight[:, : weight_shape[1]].contiguous()
    x = torch.randn(rows, weight_shape[1]).to(BF16)
    out = bf16_linear(x, weight)
    assert routes[0] == route and routes[1:] in ([], ["torch"])   # the widened product calls F.linear itself
    _assert_rounds_alike(out, _reference(x, weight, None))


@pytest.mark.parametrize("product", [linear, plain_linear])
@pytest.mark.parametrize("units, dtype, emulated", [
    (False, BF16, True),
    (True, BF16, False),          # a CPU with bfloat16 units: oneDNN's products (packed where torch can)
    (False, torch.float32, False),
])
def test_only_emulated_bfloat16_takes_the_bfloat16_route(monkeypatch, product, units, dtype, emulated):
    taken: list[int] = []

    def record(x, weight, bias=None):
        taken.append(x.shape[0])
        return F.linear(x, weight, bias)

    monkeypatch.setattr(linear_module, "bf16_linear", record)
    monkeypatch.setattr(linear_module, "_bf16_units", units)
    x, weight = torch.randn(3, 16).to(dtype), torch.randn(8, 16).to(dtype)
    torch.testing.assert_close(product(x, weight), F.linear(x, weight))
    assert taken == ([3] if emulated else [])
