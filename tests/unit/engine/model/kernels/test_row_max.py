"""The compiled `highest` against numpy's max over the same run: runs shorter than a vector, of whole vectors, with a
few left over, starting anywhere in the row, all negative, and a highest in each place a run can hold it."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from hybridpd.engine.model.kernels.row_max import highest


@numba.njit(cache=False)
def _highest_of(row, lo, hi):
    return highest(row, lo, hi)


@pytest.mark.parametrize("size, lo, hi", [
    (1, 0, 1), (15, 0, 15), (16, 0, 16), (17, 0, 17), (100, 3, 100), (100, 7, 8), (300, 33, 290), (64, 0, 48),
])
@pytest.mark.parametrize("shift", [0.0, -1000.0])
def test_matches_numpy(size, lo, hi, shift):
    row = (np.random.default_rng(size + lo).standard_normal(size) + shift).astype(np.float32)
    assert _highest_of(row, lo, hi) == row[lo:hi].max()


@pytest.mark.parametrize("where", range(0, 37))
def test_the_highest_anywhere_in_the_run(where):
    row = np.full(40, -5.0, dtype=np.float32)
    row[1:38] = np.linspace(-4, -2, 37, dtype=np.float32)
    row[1 + where] = 7.5
    row[0] = row[38] = 100.0   # outside the run: never read
    assert _highest_of(row, 1, 38) == np.float32(7.5)
