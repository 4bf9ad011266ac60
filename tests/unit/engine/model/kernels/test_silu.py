"""The compiled SiLU (kernels/silu.py) against float64's, over float32's whole useful range and at its edges."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from hybridpd.engine.model.kernels.silu import exp32, silu


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
