"""`needed_span` against a brute-force rule: the blocks that hold the keys the decoder's query at `n` can see.

The decoder computes position n itself and reads keys [0, n) from the prefill node. Full attention sees them all;
window W sees keys j with n - W < j, i.e. [max(0, n + 1 - W), n); a Mamba group needs its one state slot.
"""

from __future__ import annotations

import pytest
import torch

from hybridpd.engine.kv_cache.spec import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec


def fa(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=4, dtype=torch.float32)


def sw(window: int, block_size: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=4, dtype=torch.float32,
                             sliding_window=window)


def mamba(interval: int) -> MambaSpec:
    return MambaSpec(block_size=interval, conv_state_shape=(3, 4), ssm_state_shape=(2, 4),
                     dtypes=(torch.float32, torch.float32))


def brute_force_blocks(spec: KVCacheSpec, n: int) -> set[int]:
    if isinstance(spec, MambaSpec):
        return {0} if n > 0 else set()
    low = max(0, n + 1 - spec.sliding_window) if isinstance(spec, SlidingWindowSpec) else 0
    return {key // spec.block_size for key in range(low, n)}


def interesting_lengths(block_size: int, window: int) -> list[int]:
    points = {0, 1, 2, window - 1, window, window + 1, 2 * window, 3 * window + 1}
    points |= {k * block_size + d for k in range(1, 5) for d in (-1, 0, 1)}
    return sorted(p for p in points if p >= 0)


SPECS = [fa(1), fa(4), fa(16), mamba(8), mamba(32)] + [
    sw(window, block_size) for window in (2, 3, 5, 11, 16, 17, 64) for block_size in (1, 4, 16)
]
CASES = [
    (spec, n)
    for spec in SPECS
    for n in interesting_lengths(spec.block_size, getattr(spec, "sliding_window", spec.block_size))
]


@pytest.mark.parametrize("spec, n", CASES, ids=[f"{type(s).__name__}-{s.block_size}-{n}" for s, n in CASES])
def test_span_is_exactly_the_visible_blocks(spec, n):
    start, end = spec.needed_span(n)
    assert 0 <= start <= end
    assert set(range(start, end)) == brute_force_blocks(spec, n)


@pytest.mark.parametrize("spec, n, expected", [
    (fa(4), 0, (0, 0)),
    (fa(4), 1, (0, 1)),
    (fa(4), 8, (0, 2)),
    (fa(4), 9, (0, 3)),
    (sw(5, 4), 4, (0, 1)),      # keys 0..3 all within the window of position 4
    (sw(5, 4), 5, (0, 2)),      # keys 1..4
    (sw(5, 4), 8, (1, 2)),      # keys 4..7
    (sw(5, 4), 9, (1, 3)),      # keys 5..8
    (sw(11, 16), 40, (1, 3)),   # keys 30..39
    (mamba(8), 0, (0, 0)),
    (mamba(8), 1, (0, 1)),
    (mamba(8), 1000, (0, 1)),
])
def test_span_examples(spec, n, expected):
    assert spec.needed_span(n) == expected


@pytest.mark.parametrize("block_size, n", [(4, 8), (4, 9), (4, 11), (1, 5), (16, 0)])
def test_window_of_one_reads_at_most_the_block_position_n_is_written_to(block_size, n):
    """W=1 sees no remote key at all; the span may still name the partial block that holds position n (the
    decode side's sliding-window manager allocates and loads the same block, so both sides agree)."""
    start, end = sw(1, block_size).needed_span(n)
    assert brute_force_blocks(sw(1, block_size), n) == set()
    assert set(range(start, end)) <= {n // block_size}


def test_a_spec_without_its_kind_has_no_rules():
    with pytest.raises(NotImplementedError):
        KVCacheSpec(block_size=4).needed_span(4)
    with pytest.raises(NotImplementedError):
        KVCacheSpec(block_size=4).hit_rule()
