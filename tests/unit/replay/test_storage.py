"""The simulated storage tier (replay/storage.py): what is written once, what is read refreshes, what goes first
beyond the capacity (the least recently used, a tenth at a time, as the real store), and the changes it reports."""

from __future__ import annotations

import pytest

from hybridpd.replay.storage import SimStorage

PAGES = (10, 30)   # bytes per block of group 0 and group 1


@pytest.mark.parametrize("capacity, steps, held, evicted", [
    # (write | read, [(group, hash)])
    (100, [("write", [(0, b"a"), (0, b"a"), (1, b"b")])], [(0, b"a"), (1, b"b")], 0),   # a second write is none
    (50, [("write", [(0, b"a"), (0, b"b"), (1, b"c")]), ("write", [(0, b"d")])],       # 60 > 50: down to 45
     [(1, b"c"), (0, b"d")], 2),
    (50, [("write", [(0, b"a"), (0, b"b"), (1, b"c")]), ("read", [(0, b"a")]), ("write", [(0, b"d")])],
     [(0, b"a"), (0, b"d")], 2),                                                            # a read keeps a
    (40, [("write", [(1, b"c"), (0, b"a")]), ("write", [(1, b"e")])], [(1, b"e")], 2),
])
def test_least_recently_used_files_go_beyond_the_capacity(capacity, steps, held, evicted):
    storage = SimStorage(PAGES, capacity)
    for action, blocks in steps:
        storage.write(blocks) if action == "write" else storage.read(blocks)
    names = [bytes([c]) for c in b"abcde"]
    assert sorted((g, h) for g in (0, 1) for h in names if storage.has(g, h)) == sorted(held)
    assert storage.used == sum(PAGES[g] for g, _ in held) <= capacity
    assert storage.blocks_evicted == evicted


def test_reads_count_their_bytes_and_changes_come_out_in_order():
    storage = SimStorage(PAGES, 45)
    assert storage.empty
    storage.write([(0, b"a"), (1, b"b")])
    assert storage.read([(1, b"b"), (0, b"a")]) == 40 and storage.blocks_read == 2
    storage.write([(0, b"c")])   # 50 > 45: down to 40 at most, from the least recently used (b, read first)
    assert storage.take_changes() == [(True, 0, b"a"), (True, 1, b"b"), (True, 0, b"c"), (False, 1, b"b")]
    assert storage.take_changes() == [] and not storage.empty


def test_a_capacity_must_be_positive():
    with pytest.raises(ValueError, match="--kv-offload-size"):
        SimStorage(PAGES, 0)
