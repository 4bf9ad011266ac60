"""`linear`: which product takes a step's rows (oneDNN only for whole multiples of ONEDNN_ROWS, so its primitive
cache meets a bounded set of shapes), and that both agree with `F.linear` to float32 rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridpd.engine.model.kernels import linear as linear_module
from hybridpd.engine.model.kernels.linear import ONEDNN_ROWS, linear, onednn_rows_pay
from tests.unit.engine.model.kernels.linear_cases import check_agrees_with_f_linear


@pytest.fixture
def onednn_calls(monkeypatch):
    """Records the row counts oneDNN is given (and still computes the product, through F.linear)."""
    calls: list[int] = []

    def recorder(x, weight, bias, *args):
        calls.append(x.shape[0])
        return F.linear(x, weight, bias)

    monkeypatch.setattr(linear_module, "_onednn", recorder)
    monkeypatch.setattr(linear_module, "_f32_packing", False)   # a CPU whose float32 products stay with MKL
    return calls


@pytest.mark.parametrize("rows, dtype, contiguous, onednn", [
    (1, torch.float32, True, False),                       # a decode step
    (ONEDNN_ROWS - 1, torch.float32, True, False),
    (ONEDNN_ROWS, torch.float32, True, True),
    (ONEDNN_ROWS + 1, torch.float32, True, False),         # not a whole multiple: all MKL, never split
    (2 * ONEDNN_ROWS, torch.float32, True, True),
    (3 * ONEDNN_ROWS - 7, torch.float32, True, False),
    (2 * ONEDNN_ROWS, torch.float64, True, False),         # another dtype
    (2 * ONEDNN_ROWS, torch.float32, False, False),        # strided rows
])
def test_only_whole_multiples_of_float32_rows_go_to_onednn(onednn_calls, rows, dtype, contiguous, onednn):
    weight = torch.randn(8, 6, dtype=dtype)
    x = torch.randn(rows, 12, dtype=dtype)[:, :6] if not contiguous else torch.randn(rows, 6, dtype=dtype)
    out = linear(x, weight)
    assert onednn_calls == ([rows] if onednn else [])
    torch.testing.assert_close(out, F.linear(x, weight))


ONEDNN = linear_module._find_onednn()


@pytest.mark.skipif(ONEDNN is None, reason="this torch build has no oneDNN linear")
@pytest.mark.parametrize("rows, inputs, outputs, with_bias", [
    (ONEDNN_ROWS, 128, 580, False), (2 * ONEDNN_ROWS, 256, 128, True), (ONEDNN_ROWS, 64, 640, True),
])
def test_onednn_agrees_with_mkl(monkeypatch, rows, inputs, outputs, with_bias):
    monkeypatch.setattr(linear_module, "_onednn", ONEDNN)        # taken on a CPU with AVX-512; checked on any
    monkeypatch.setattr(linear_module, "_f32_packing", False)    # the packs would take the rows first
    check_agrees_with_f_linear(linear, rows, inputs, outputs, with_bias)


@pytest.mark.parametrize("flags, pays", [
    ({"avx2", "fma", "avx512f"}, True),
    ({"avx2", "fma"}, False),   # MKL runs the products at the machine's peak there
    (set(), False),
])
def test_whole_multiples_go_to_onednn_only_on_a_cpu_with_avx512(flags, pays):
    assert onednn_rows_pay(frozenset(flags)) is pays
