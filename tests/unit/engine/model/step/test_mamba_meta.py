"""Decode slots that form an ascending progression are addressed by a slice (a view of the cache)."""

import pytest

from hybridpd.engine.model.step.mamba_meta import _progression


@pytest.mark.parametrize(
    "slots, expected",
    [
        ([5], slice(5, 6, 1)),
        ([1, 2, 3], slice(1, 4, 1)),
        ([1, 10, 19, 28], slice(1, 29, 9)),
        ([3, 1], None),
        ([1, 1], None),
        ([1, 2, 4], None),
        ([0, 7, 14, 22], None),
    ],
)
def test_progression(slots, expected):
    got = _progression(slots)
    assert got == expected
    if got is not None:
        assert list(range(100)[got]) == slots
