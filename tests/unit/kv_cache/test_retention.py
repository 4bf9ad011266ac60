"""Sparse retention of Mamba states: which boundaries a request saves, and that a shared prefix still hits."""

from __future__ import annotations

import pytest

from hybridpd.config import MambaRetentionPolicy
from hybridpd.engine.kv_cache.retention import MambaRetention

from .builders import Req, fa, mamba, manager, prefill


@pytest.mark.parametrize("prompt, shared, kept", [
    (40, 0, {4, 5, 6, 7, 9, 13}),          # interval 8: the prompt's end (5, 4), then 1, 2, 4, 8 past it
    (44, 0, {4, 5, 6, 7, 9, 13}),
    (40, 17, {2, 4, 5, 6, 7, 9, 13}),      # the prefix full attention found cached: 17 -> boundary 2
    (40, 7, {4, 5, 6, 7, 9, 13}),          # less than one interval shared: nothing more
    (8, 0, {0, 1, 2, 3, 5, 9}),            # boundary 0 is never asked for (no state at 0 tokens)
])
def test_which_boundaries_are_kept(prompt, shared, kept):
    retention = MambaRetention(num_prompt_tokens=prompt, shared_tokens=shared, interval=8)
    assert {k for k in range(0, 16) if retention.keeps(k)} == kept


def test_every_keeps_everything():
    retention = MambaRetention(num_prompt_tokens=40, shared_tokens=0, interval=8, every=True)
    assert all(retention.keeps(k) for k in range(1, 30))


def _saved(m, tokens) -> list[int]:
    return [n for n in range(8, len(tokens) + 1, 8) if m.cached_block(1, _chain(tokens)[n // 8 - 1]) is not None]


def _chain(tokens):
    from hybridpd.engine.kv_cache.hashing import RequestBlockHashes
    return RequestBlockHashes(None).chain(8, tokens)


def test_a_shared_prefix_hits_from_its_third_occurrence():
    """The first prompt saves its end; the second finds the shared prefix in full attention only and saves the
    state there; the third hits it in every group."""
    m = manager(fa(4), mamba(8), retention=MambaRetentionPolicy.SPARSE)
    shared = list(range(100, 124))                                  # 24 tokens: boundary 3
    first = shared + list(range(1, 21))                             # 44 tokens
    prefill(m, Req("a", first))
    m.free("a")
    assert _saved(m, first) == [32, 40]
    second = shared + list(range(50, 70))
    assert prefill(m, Req("b", second)) == 0                        # no Mamba state at 24 yet
    m.free("b")
    assert 24 in _saved(m, second)
    third = shared + list(range(80, 90))
    assert prefill(m, Req("c", third)) == 24
    m.free("c")
    m.check_invariants()
