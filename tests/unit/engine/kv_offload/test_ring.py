"""The staging ring: ranges come back in the order they went out, never overlap, stay inside the buffer, and
`room` is exactly the longest range `take` hands out; checked against a brute-force model of the buffer's bytes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpd.engine.kv_offload.ring import ByteRing


@pytest.mark.parametrize("size, takes, gives, expected, room", [
    (10, [4, 4], 0, [0, 4], 2),            # in order from 0
    (10, [4, 4, 3], 0, [0, 4, None], 2),   # 2 left at the end, none before
    (10, [4, 4, 3], 1, [0, 4, 0], 1),      # the end is too short: wraps to 0, before the oldest range
    (10, [4, 4, 2], 1, [0, 4, 8], 4),      # fits at the end
    (10, [4, 4, 4, 1], 1, [0, 4, 0, None], 0),   # wrapped up to the oldest range: full
    (10, [10], 0, [0], 0),
    (10, [11], 0, [None], 10),
])
def test_take_and_room(size, takes, gives, expected, room):
    ring = ByteRing(size)
    offsets = []
    for i, length in enumerate(takes):
        if i == 2:
            for _ in range(gives):
                ring.give_back()
        offsets.append(ring.take(length))
    assert offsets == expected
    assert ring.room() == room


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        ByteRing(0)
    with pytest.raises(ValueError):
        ByteRing(8).take(0)


@settings(max_examples=300, deadline=None)
@given(size=st.integers(1, 40), ops=st.lists(st.one_of(st.integers(1, 45), st.none()), max_size=60))
def test_ranges_never_overlap_and_room_is_what_take_gives(size, ops):
    ring = ByteRing(size)
    used = [False] * size          # the brute-force model: which bytes are out
    out: list[tuple[int, int]] = []
    for op in ops:
        if op is None:             # give the oldest back
            if out:
                offset, length = out.pop(0)
                ring.give_back()
                used[offset: offset + length] = [False] * length
            continue
        room = ring.room()
        offset = ring.take(op)
        assert (offset is None) == (op > room)
        if offset is not None:
            assert 0 <= offset and offset + op <= size
            assert not any(used[offset: offset + op])
            used[offset: offset + op] = [True] * op
            out.append((offset, op))
        assert ring.taken == len(out)
    while out:
        out.pop(0)
        ring.give_back()
    assert ring.room() == size
