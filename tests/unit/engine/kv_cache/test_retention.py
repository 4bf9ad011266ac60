"""Sparse retention of Mamba states: which boundaries a request saves, and that a shared prefix still hits."""

from __future__ import annotations

import pytest

from hybridpd.config import MambaRetentionPolicy
from hybridpd.engine.kv_cache.retention import MambaRetention

from .builders import Req, fa, mamba, manager, prefill


@pytest.mark.parametrize("prompt, shared, kept", [
    # interval 8. K = 5: checkpoints every interval (step 2^(3-3)), then 1, 2, 4, 8 past K
    (40, 0, {0, 1, 2, 3, 4, 5, 6, 7, 9, 13}),
    # K = 20: the end (20, 19), checkpoints every 4 (2^(5-3)), the shared prefix (shared 57 -> 7), then 21, 22, 24, 28
    (160, 0, {0, 4, 8, 12, 16, 19, 20, 21, 22, 24, 28}),
    (160, 57, {0, 4, 7, 8, 12, 16, 19, 20, 21, 22, 24, 28}),
    (160, 7, {0, 4, 8, 12, 16, 19, 20, 21, 22, 24, 28}),     # less than one interval shared: nothing more
    # K = 100: checkpoints every 16
    (800, 0, {0, 16, 32, 48, 64, 80, 96, 99, 100, 101, 102, 104, 108}),
])
def test_which_boundaries_are_kept(prompt, shared, kept):
    retention = MambaRetention(num_prompt_tokens=prompt, shared_tokens=shared, interval=8)
    # (boundary 0 is never asked for: there is no state at 0 tokens)
    assert {k for k in range(0, prompt // 8 + 9) if retention.keeps(k)} == kept


def test_every_keeps_everything():
    retention = MambaRetention(num_prompt_tokens=40, shared_tokens=0, interval=8, every=True)
    assert all(retention.keeps(k) for k in range(1, 30))


def _saved(m, tokens) -> list[int]:
    return [n for n in range(8, len(tokens) + 1, 8) if m.cached_block(1, _chain(tokens)[n // 8 - 1]) is not None]


def _chain(tokens):
    from hybridpd.engine.kv_cache.hashing import RequestBlockHashes
    return RequestBlockHashes(None).chain(8, tokens)


def test_a_shared_prefix_hits_at_a_checkpoint_then_where_it_ends():
    """The first prompt saves its end and its checkpoints; the second hits the checkpoint below the shared prefix
    and saves the state where the prefix ends (full attention showed it shared); the third hits there."""
    m = manager(fa(4), mamba(8), retention=MambaRetentionPolicy.SPARSE)
    shared = list(range(1000, 1100))                                 # 100 tokens: boundary 12 (96)
    first = shared + list(range(1, 61))                              # 160 tokens: K = 20, checkpoints every 4
    prefill(m, Req("a", first))
    m.free("a")
    assert _saved(m, first) == [32, 64, 96, 128, 152, 160]
    second = shared + list(range(2000, 2030))
    assert prefill(m, Req("b", second)) == 96                        # the checkpoint at 12 intervals
    m.free("b")
    assert 96 in _saved(m, second)
    m.check_invariants()
