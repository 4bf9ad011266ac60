"""The few-rows kernel: it agrees with `F.linear` to float32 rounding, a row's result does not depend on the rows
beside it, and `linear` sends it only what it is for (2..FEW_ROWS_MAX float32 contiguous rows, a large weight; one
row where float32 products pack)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridpd.engine.model.kernels import linear as linear_module
from hybridpd.engine.model.kernels.few_rows import few_rows_linear
from hybridpd.engine.model.kernels.linear import FEW_ROWS_MAX, FEW_ROWS_MIN_WEIGHT, linear
from tests.unit.engine.model.kernels.linear_cases import check_agrees_with_f_linear


@pytest.mark.parametrize("rows, inputs, outputs, with_bias", [
    (1, 64, 40, False), (2, 64, 40, True), (3, 7, 5, False), (4, 128, 33, True), (5, 256, 64, False),
    (8, 768, 130, True), (13, 96, 17, False),
])
def test_agrees_with_f_linear(rows, inputs, outputs, with_bias):
    check_agrees_with_f_linear(few_rows_linear, rows, inputs, outputs, with_bias)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 200, generator=gen)
    weight = torch.randn(24, 200, generator=gen)
    alone = torch.cat([few_rows_linear(x[i : i + 1].contiguous(), weight) for i in range(8)])
    for rows in range(2, 9):
        for start in range(0, 8 - rows + 1):
            batch = few_rows_linear(x[start : start + rows].contiguous(), weight)
            assert torch.equal(batch, alone[start : start + rows]), (rows, start)
    reversed_rows = few_rows_linear(x.flip(0).contiguous(), weight)
    assert torch.equal(reversed_rows.flip(0), alone)


@pytest.fixture
def kernel_calls(monkeypatch):
    calls: list[int] = []

    def recorder(x, weight, bias=None):
        calls.append(x.shape[0])
        return F.linear(x, weight, bias)

    monkeypatch.setattr(linear_module, "few_rows_linear", recorder)
    monkeypatch.setattr(linear_module, "packed_linear", lambda x, weight, bias=None: F.linear(x, weight, bias))
    return calls


LARGE = (FEW_ROWS_MIN_WEIGHT // 64, 64)


@pytest.mark.parametrize("rows, weight_shape, dtype, contiguous, float32_packs, taken", [
    (2, LARGE, torch.float32, True, False, True),
    (FEW_ROWS_MAX, LARGE, torch.float32, True, False, True),
    (1, LARGE, torch.float32, True, False, False),                 # one row: MKL is as fast
    (FEW_ROWS_MAX + 1, LARGE, torch.float32, True, False, False),  # MKL catches up
    (4, (LARGE[0] // 2, 64), torch.float32, True, False, False),   # a small weight: the call costs more than it saves
    (4, LARGE, torch.float64, True, False, False),
    (4, LARGE, torch.float32, False, False, False),                # strided rows
    (1, LARGE, torch.float32, True, True, True),     # where float32 packs: one row reads faster here than packed
    (2, LARGE, torch.float32, True, True, False),    # from two rows the pack
    (1, (LARGE[0] // 2, 64), torch.float32, True, True, False),
])
def test_linear_sends_the_kernel_only_what_it_is_for(monkeypatch, kernel_calls, rows, weight_shape, dtype, contiguous,
                                                     float32_packs, taken):
    monkeypatch.setattr(linear_module, "_f32_packing", float32_packs)
    weight = torch.randn(*weight_shape, dtype=dtype) / 8
    x = torch.randn(rows, 128, dtype=dtype)[:, :64] if not contiguous else torch.randn(rows, 64, dtype=dtype)
    out = linear(x, weight)
    assert kernel_calls == ([rows] if taken else [])
    torch.testing.assert_close(out, F.linear(x, weight))


@pytest.mark.parametrize("x_shape, weight_shape, bias_shape", [((2, 5), (3, 6), None), ((2, 6), (3, 6), (4,))])
def test_shapes_that_do_not_fit_are_refused_before_the_kernel_reads(x_shape, weight_shape, bias_shape):
    bias = torch.zeros(bias_shape) if bias_shape else None
    with pytest.raises(ValueError, match="do not fit"):
        few_rows_linear(torch.zeros(x_shape), torch.zeros(weight_shape), bias)
