"""The compiled SiLU (kernels/silu.py) against float64's, over float32's whole useful range and at its edges; an MLP's
`silu(gate) * up` in one pass against torch's, and every expert's weighted product at once."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hybridpd.engine.model.kernels.silu import exp32, silu, silu_times, silu_times_weighted


@numba.njit(error_model="numpy")
def _map(values, which):
    out = np.empty_like(values)
    for i in range(values.shape[0]):
        out[i] = silu(values[i]) if which == 0 else exp32(values[i])
    return out


def test_exp_is_within_two_float32_steps_of_float64_across_its_range():
    x = np.linspace(-87.0, 88.0, 400_001, dtype=np.float32)
    got = _map(x, 1).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - want) / want) < 2.5e-7


def test_silu_is_within_float32_rounding_of_float64():
    x = np.concatenate([np.linspace(-100.0, 100.0, 200_001), np.linspace(-1e-3, 1e-3, 2_001)]).astype(np.float32)
    got = _map(x, 0).astype(np.float64)
    want = x.astype(np.float64) / (1.0 + np.exp(-x.astype(np.float64)))
    assert np.max(np.abs(got - want)) < 1e-5
    big = np.abs(want) > 1e-30
    assert np.max(np.abs(got[big] - want[big]) / np.abs(want[big])) < 5e-7


@pytest.mark.parametrize("value, expected", [
    (0.0, 0.0), (1000.0, 1000.0), (-1000.0, 0.0), (88.3, 88.3), (-88.3, 0.0), (np.inf, np.inf),
])
def test_edges_saturate_without_overflow(value, expected):
    got = float(_map(np.array([value], dtype=np.float32), 0)[0])
    assert got == pytest.approx(expected, rel=1e-7, abs=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, inter", [(1, 8), (5, 24), (7, 40), (300, 64)])
def test_silu_times_is_torchs_product_computed_in_float32_and_rounded_once(dtype, rows, inter):
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    got = silu_times(gate_up)
    want = (F.silu(gate.double()) * up.double()).to(dtype)
    assert got.dtype == dtype and got.shape == (rows, inter)
    tolerance = 1e-6 if dtype == torch.float32 else 2 ** -8   # float32 rounding; one bfloat16 step
    torch.testing.assert_close(got.double(), want.double(), rtol=tolerance, atol=1e-6)


@pytest.mark.parametrize("gate_up", [
    torch.zeros(2, 5),                              # no two halves
    torch.zeros(8, 2).t(),                          # strided
    torch.zeros(2, 8, dtype=torch.float64),
    torch.zeros(2, 2, 4),
])
def test_silu_times_refuses_what_it_cannot_read(gate_up):
    with pytest.raises(ValueError, match="silu_times"):
        silu_times(gate_up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, experts, inter, top_k", [(1, 1, 8, 1), (5, 4, 24, 2), (30, 16, 64, 4), (7, 3, 40, 3)])
def test_silu_times_weighted_is_each_experts_weighted_product_rounded_once(dtype, rows, experts, inter, top_k):
    gen = torch.Generator().manual_seed(rows * experts + inter)
    gate_up = (torch.randn(rows, experts * 2 * inter, generator=gen) * 4).to(dtype)
    chosen = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(rows)])
    weights = torch.zeros(rows, experts).scatter_(1, chosen, torch.rand(rows, top_k, generator=gen)).to(dtype)
    got = silu_times_weighted(gate_up, weights)
    halves = gate_up.double().view(rows, experts, 2, inter)
    want = (F.silu(halves[:, :, 0]) * halves[:, :, 1] * weights.double()[:, :, None]).view(rows, experts * inter)
    assert got.dtype == dtype and got.shape == (rows, experts * inter)
    tolerance = 1e-6 if dtype == torch.float32 else 2 ** -8   # float32 rounding; one bfloat16 step
    torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=tolerance, atol=1e-6)
    unchosen = (weights == 0)[:, :, None].expand(rows, experts, inter).reshape(rows, experts * inter)
    assert not got[unchosen].any()   # an expert the row did not choose: exact zeros, whatever its gate


@pytest.mark.parametrize("gate_up, weights", [
    (torch.zeros(2, 12), torch.zeros(2, 4)),                      # 12 columns are not 4 experts' two halves
    (torch.zeros(2, 16), torch.zeros(3, 4)),                      # other rows
    (torch.zeros(16, 2).t(), torch.zeros(2, 4)),                  # strided
    (torch.zeros(2, 16), torch.zeros(2, 4, dtype=torch.bfloat16)),  # two dtypes
    (torch.zeros(2, 16, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64)),
    (torch.zeros(2, 16), torch.zeros(2, 0)),
])
def test_silu_times_weighted_refuses_what_it_cannot_read(gate_up, weights):
    with pytest.raises(ValueError, match="silu_times_weighted"):
        silu_times_weighted(gate_up, weights)
