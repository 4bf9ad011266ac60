"""The offload directory on its own: a block file accepts only the block and groups it names, whole; the pages of
several groups share one file, and a hash's groups may come in several; writes are atomic and content-addressed, so
writers sharing a directory never tear a file; the capacity evicts least recently used; a
scan learns what other writers did from their journals, and what none journaled from a full listing."""

from __future__ import annotations

import errno
import os
import random
import threading
import time

import pytest

from hybridpd.engine.kv_offload import block_file
from hybridpd.engine.kv_offload import store as store_module
from hybridpd.engine.kv_offload.file_reader import ReadOutcome, read_into
from hybridpd.engine.kv_offload.layout import GroupLayout
from hybridpd.engine.kv_offload.store import LISTING_PAUSE_S, OffloadStore

MODEL, OTHER_MODEL = b"m" * 32, b"o" * 32
GROUP = b"g" * 16
PAGE = 64


def store(root, capacity=1 << 20, model=MODEL, feed=True) -> OffloadStore:
    return OffloadStore(root, model, (GroupLayout(GROUP, PAGE), GroupLayout(b"h" * 16, PAGE)), capacity, feed=feed)


def block(i: int) -> tuple[bytes, memoryview]:
    return bytes([i]) * 32, memoryview(bytes([i % 251]) * PAGE)


def encoded(h: bytes, payload: bytes) -> bytes:
    return block_file.encode_header(MODEL, h, [(GROUP, payload)]) + payload


OTHER_GROUP = b"h" * 16
PAGE2 = 2 * PAGE
# A file of two pages: header (magic 0:8, version 8:12, model 12:44, hash 44:76, pages 76:80), then per page its
# group key, length and checksum (40 bytes each, from 80), then the payloads.
LAYOUTS = [(GROUP, PAGE), (OTHER_GROUP, PAGE2)]


@pytest.mark.parametrize("change, layouts, accepted", [
    (lambda data: data, LAYOUTS, True),
    (lambda data: data[:-1], LAYOUTS, False),                                   # truncated
    (lambda data: data + b"\0", LAYOUTS, False),                                # longer
    (lambda data: data[:-1] + bytes([data[-1] ^ 1]), LAYOUTS, False),           # the second payload's bit flipped
    (lambda data: data[:161] + bytes([data[161] ^ 1]) + data[162:], LAYOUTS, False),  # the first payload's
    (lambda data: b"X" + data[1:], LAYOUTS, False),                             # not our magic
    (lambda data: data[:12] + OTHER_MODEL + data[44:], LAYOUTS, False),         # another model's block
    (lambda data: data[:44] + b"\7" * 32 + data[76:], LAYOUTS, False),          # another block hash
    (lambda data: data[:80] + b"x" * 16 + data[96:], LAYOUTS, False),           # the first page another group's
    (lambda data: data, LAYOUTS[::-1], False),                                  # the groups in another order
    (lambda data: data, LAYOUTS[:1], False),                                    # fewer groups than it holds
    (lambda data: data, [(GROUP, PAGE), (OTHER_GROUP, PAGE)], False),           # a page of another size
])
def test_a_block_file_is_accepted_only_whole_and_as_what_it_names(tmp_path, change, layouts, accepted):
    h = block(3)[0]
    payloads = [bytes(range(PAGE)), bytes(range(100, 100 + PAGE2))]
    path = tmp_path / "block.kv"
    path.write_bytes(change(block_file.encode_header(MODEL, h, list(zip((GROUP, OTHER_GROUP), payloads)))
                            + b"".join(payloads)))
    pages = [memoryview(bytearray(size)) for _, size in layouts]
    assert read_into(str(path), MODEL, h, layouts, pages) == (ReadOutcome.READ if accepted else ReadOutcome.BAD)
    if accepted:
        assert [bytes(page) for page in pages] == payloads


def test_a_store_without_a_feed_keeps_no_changes(tmp_path):
    """A node that publishes no KV events never takes the changes: none may pile up."""
    writer, other = store(tmp_path / "a", feed=False), store(tmp_path / "a", feed=False)
    h, payload = block(1)
    writer.write(0, h, payload)
    other.scan(full=True)
    assert writer.take_changes() == [] and other.take_changes() == []
    assert writer.holds(0, h) and other.holds(0, h)


def test_write_then_read_and_a_bad_file_is_removed(tmp_path):
    s = store(tmp_path)
    h, payload = block(1)
    assert s.write(0, h, payload) and not s.write(0, h, payload)   # the second write finds it there
    assert bytes(s.read(0, h)) == bytes(payload)
    assert s.read(1, h) is None                                   # the other group has no such block
    path = s.path(0, h)
    path.write_bytes(path.read_bytes()[:-3])
    assert s.take_changes() == [(True, 0, h)]
    assert s.read(0, h) is None and not path.exists() and s.take_changes() == [(False, 0, h)]
    assert s.scan() == (set(), set())


def test_write_many_answers_for_each_block_and_journals_them_in_one_append(tmp_path, monkeypatch):
    s, other = store(tmp_path), store(tmp_path)
    other.scan()
    (h1, p1), (h2, p2), (h3, p3) = block(1), block(2), block(3)
    s.write(0, h2, p2)
    write_file = OffloadStore._write_file

    def disk_full_for_h3(self, block_hash, pages):
        if block_hash == h3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_file(self, block_hash, pages)

    monkeypatch.setattr(OffloadStore, "_write_file", disk_full_for_h3)
    appends = []
    append = s._journal.append
    monkeypatch.setattr(s._journal, "append", lambda changes: appends.append(list(changes)) or append(changes))
    results = s.write_many([(h1, [(0, p1)]), (h2, [(0, p2)]), (h3, [(0, p3)])])
    assert results[:2] == [1, 0] and isinstance(results[2], OSError) and results[2].errno == errno.ENOSPC
    assert [len(batch) for batch in appends] == [1]        # h1 alone: h2 was there, h3 never landed
    assert other.scan()[0] == {h1, h2}
    assert s.used_bytes() == 2 * s.file_bytes(0b01)


def test_the_pages_of_several_groups_share_one_file_and_a_hash_may_have_several(tmp_path):
    s, other = store(tmp_path), store(tmp_path)
    other.scan()
    h, p0 = block(1)
    p1 = memoryview(bytes([7]) * PAGE)
    assert s.write_many([(h, [(1, p1), (0, p0)])]) == [2]
    assert [p.name for p in tmp_path.rglob("*.kv")] == [f"{h.hex()}.3.kv"]
    assert s.take_changes() == [(True, 0, h), (True, 1, h)]
    assert s.used_bytes() == s.file_bytes(0b11) == block_file.header_size(2) + 2 * PAGE
    assert {g: bytes(page) for g, page in s.read_many(h, [0, 1]).items()} == {0: bytes(p0), 1: bytes(p1)}
    assert other.scan() == ({h}, {h}) and bytes(other.read(1, h)) == bytes(p1)   # one journal line for both
    assert not s.write(0, h, p0)                          # group 0's page is there already, in the shared file

    h2, q0 = block(2)
    s.write(0, h2, q0)
    s.write(1, h2, p1)                                    # a later write of another group: a second file
    assert sorted(p.name for p in tmp_path.rglob(f"{h2.hex()}.*")) == [f"{h2.hex()}.1.kv", f"{h2.hex()}.2.kv"]
    assert {g: bytes(page) for g, page in s.read_many(h2, [0, 1]).items()} == {0: bytes(q0), 1: bytes(p1)}
    s.take_changes()
    s.path(1, h2).unlink()                                # one of them gone: only its group loses the block
    assert s.read_many(h2, [0, 1]) is None and s.holds(0, h2) and not s.holds(1, h2)
    assert s.take_changes() == [(False, 1, h2)]

    s.path(0, h).write_bytes(b"torn")                     # a bad shared file: both groups lose the block
    assert s.read(0, h) is None and s.take_changes() == [(False, 0, h), (False, 1, h)]
    assert other.scan() == ({h2}, {h2})                   # the torn file's removal is journaled, the unlink not
    assert other.scan(full=True) == ({h2}, set())


def test_a_write_finds_the_groups_another_writer_has_just_written(tmp_path):
    """Nodes write the same prefix moments apart, each with the groups its own step cached: a write looks for the
    block under every set of groups files have been seen with, and writes only what no file holds."""
    s, other = store(tmp_path), store(tmp_path)
    (h0, p0), (h, p), (h2, q), (h3, r) = block(0), block(1), block(2), block(3)
    other.write_many([(h0, [(0, p0), (1, p0)])])
    other.write(1, h3, r)
    s.scan()                                              # has seen files of both groups and of group 1 alone
    assert s.take_changes()
    other.write_many([(h, [(0, p), (1, p)])])
    other.write(1, h2, q)
    assert s.write_many([(h, [(0, p)]), (h2, [(0, q), (1, q)])]) == [0, 1]
    assert sorted(p.name for p in tmp_path.rglob("*.kv")) == sorted(
        [f"{h0.hex()}.3.kv", f"{h3.hex()}.2.kv", f"{h.hex()}.3.kv", f"{h2.hex()}.2.kv", f"{h2.hex()}.1.kv"])
    assert s.take_changes() == [(True, 0, h), (True, 1, h), (True, 1, h2), (True, 0, h2)]


def test_another_model_never_sees_the_files(tmp_path):
    h, payload = block(1)
    store(tmp_path).write(0, h, payload)
    other = store(tmp_path, model=OTHER_MODEL)
    assert other.scan() == (set(), set()) and other.read(0, h) is None


def test_capacity_evicts_the_least_recently_used(tmp_path):
    file_size = block_file.header_size(1) + PAGE
    s = store(tmp_path, capacity=4 * file_size)
    hashes = []
    for i in range(4):
        h, payload = block(i)
        s.write(0, h, payload)
        os.utime(s.path(0, h), (time.time() - 100 + i, time.time() - 100 + i))   # written in order, seconds apart
        hashes.append(h)
    assert s.read(0, hashes[0]) is not None   # read: now the most recently used
    s.take_changes()
    h, payload = block(9)
    s.write(0, h, payload)                    # over capacity: evict down to 9/10 of it
    assert [block_hash for held, _, block_hash in s.take_changes() if not held] == [hashes[1], hashes[2]]
    assert s.scan()[0] == {hashes[0], hashes[3], h}


def test_eviction_passes_over_a_file_that_only_looks_like_a_block(tmp_path):
    """A `.kv` name that is not a hash (another tool's file) is no block for the scan, nor for the eviction."""
    file_size = block_file.header_size(1) + PAGE
    s = store(tmp_path, capacity=2 * file_size)
    h, payload = block(1)
    s.write(0, h, payload)
    stray = s.path(0, h).with_name("not-a-hash.kv")
    stray.write_bytes(b"x")
    os.utime(stray, (time.time() - 3600, time.time() - 3600))   # the oldest file there
    s.take_changes()
    for i in (2, 3):
        s.write(0, *block(i))                 # the third block: over capacity, evicted down to 9/10 of it
    removed = [block_hash for held, _, block_hash in s.take_changes() if not held]
    assert removed == [h, block(2)[0]] and stray.exists()


def test_writers_sharing_a_directory_never_tear_a_file(tmp_path):
    stores = [store(tmp_path) for _ in range(4)]
    blocks = [block(i) for i in range(20)]
    errors = []

    def write_all(s: OffloadStore) -> None:
        try:
            for h, payload in blocks:
                s.write(0, h, payload)
                assert bytes(s.read(0, h)) == bytes(payload)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write_all, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert stores[0].scan()[0] == {h for h, _ in blocks}
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_stale_temporary_file_is_removed_by_a_scan(tmp_path):
    s = store(tmp_path)
    h, payload = block(1)
    s.write(0, h, payload)
    temp = s.path(0, h).with_name(".leftover.1.2.tmp")
    temp.write_bytes(b"half")
    s.scan(full=True)
    assert temp.exists()                      # young: a writer may still be renaming it
    os.utime(temp, (time.time() - 3600, time.time() - 3600))
    s.scan(full=False)
    assert temp.exists()                      # only a full listing looks at temporaries
    s.scan(full=True)
    assert not temp.exists()


def _by_hand(s: OffloadStore, h: bytes) -> None:
    """A block file that lands without a journal line (copied in by hand, or its writer died before journaling)."""
    s.path(0, h).parent.mkdir(parents=True, exist_ok=True)
    s.path(0, h).write_bytes(encoded(h, bytes(PAGE)))


def test_a_scan_reads_what_other_writers_journaled_without_listing_the_directory(tmp_path, monkeypatch):
    s, other = store(tmp_path), store(tmp_path)
    assert s.scan() == (set(), set())                     # the first scan lists the directory
    listed = []
    monkeypatch.setattr("hybridpd.engine.kv_offload.store._names", lambda shard: listed.append(shard) or [])
    (h1, p1), (h2, p2) = block(1), block(2)
    other.write(0, h1, p1)
    other.write(1, h2, p2)
    assert s.scan() == ({h1}, {h2}) and listed == []
    assert s.take_changes() == [(True, 0, h1), (True, 1, h2)]   # what the tier reports as KV events
    other.path(0, h1).write_bytes(b"torn")
    assert other.read(0, h1) is None                      # the other writer removes the bad file, and journals it
    assert s.scan() == (set(), {h2}) and listed == []
    assert s.take_changes() == [(False, 0, h1)]


def test_a_change_no_journal_told_is_found_by_the_next_full_listing(tmp_path, monkeypatch):
    s = store(tmp_path)
    h, payload = block(1)
    s.write(0, h, payload)
    hidden = block(2)[0]
    _by_hand(s, hidden)
    s.path(0, h).unlink()
    assert s.scan(full=False)[0] == {h}
    s.take_changes()
    assert s.scan(full=True)[0] == {hidden}
    assert s.take_changes() == [(False, 0, h), (True, 0, hidden)]
    _by_hand(s, h)
    assert s.scan()[0] == {hidden}                        # the last full listing was less than FULL_SCAN_S ago


def test_scans_list_the_whole_directory_every_full_scan_s(tmp_path, monkeypatch):
    monkeypatch.setattr("hybridpd.engine.kv_offload.store.FULL_SCAN_S", 0.0)
    monkeypatch.setattr("hybridpd.engine.kv_offload.store.FULL_SCAN_CPU_SHARE", float("inf"))
    s = store(tmp_path)
    h = block(1)[0]
    assert s.scan()[0] == set()
    _by_hand(s, h)
    assert s.scan()[0] == {h}


def test_a_read_of_a_file_that_is_gone_forgets_it(tmp_path):
    s, other = store(tmp_path), store(tmp_path)
    h, payload = block(1)
    other.write(0, h, payload)
    assert s.scan()[0] == {h}
    other.path(0, h).unlink()                             # by hand: no journal says so
    assert s.read(0, h) is None and s.scan(full=False)[0] == set()


def _on_disk(root) -> set[bytes]:
    """Brute force: every block hash some file under `root` holds group 0's page of, parsed from the file's name."""
    names = [p.name.split(".") for p in root.rglob("*.kv")]
    return {bytes.fromhex(name[0]) for name in names if len(name) == 3 and int(name[1], 16) & 1}


def test_scans_agree_with_a_listing_of_the_whole_directory(tmp_path):
    """Random writes by this store and another, removals the other journals (a bad file it read), and changes no
    journal tells (files written or removed by hand, stray files, temporaries): after journaled changes alone a scan
    that reads only the journals answers what a brute-force listing says; after any other change a full listing
    does."""
    rng = random.Random(5)
    s, other = store(tmp_path), store(tmp_path)
    unjournaled = False
    for _ in range(400):
        h = bytes([rng.randrange(3)]) + bytes([rng.randrange(6)]) * 31     # three shards, a few files each
        action = rng.choice(("write", "write", "own write", "bad file", "by hand", "remove by hand", "stray",
                             "temporary"))
        path = other.path(0, h)
        if action == "write":
            other.write(0, h, memoryview(bytes(PAGE)))
        elif action == "own write":
            s.write(0, h, memoryview(bytes(PAGE)))
        elif action == "bad file" and path.exists():
            path.write_bytes(b"torn")
            assert other.read(0, h) is None
        elif action == "by hand":
            unjournaled |= not path.exists()
            _by_hand(other, h)
        elif action == "remove by hand" and path.exists():
            path.unlink()
            unjournaled = True
        elif action == "stray" and path.parent.exists():
            (path.parent / f"notes-{rng.randrange(3)}.txt").write_text("not a block")
        elif action == "temporary" and path.parent.exists():
            (path.parent / f".{h.hex()}.1.2.tmp").write_bytes(b"half")
        if unjournaled:
            assert s.scan(full=True)[0] == _on_disk(tmp_path)
            unjournaled = False
        else:
            assert s.scan(full=False)[0] == _on_disk(tmp_path)


@pytest.mark.parametrize("burst_s, pauses_expected", [(0.0, True), (3600.0, False)])
def test_a_paced_listing_pauses_between_shard_folders_and_finds_what_one_at_once_finds(tmp_path, monkeypatch,
                                                                                      burst_s, pauses_expected):
    writer = store(tmp_path)
    blocks = [block(i) for i in range(40)]                # 40 hashes: 40 shard folders
    for i, (h, payload) in enumerate(blocks):
        writer.write(i % 2, h, payload)
    at_once = store(tmp_path).scan(full=True)
    pauses: list[float] = []
    monkeypatch.setattr("hybridpd.engine.kv_offload.store.LISTING_BURST_S", burst_s)
    monkeypatch.setattr("time.sleep", pauses.append)        # the store's pauses, counted instead of slept
    paced = store(tmp_path).scan(full=True, paced=True)
    assert paced == at_once == ({h for i, (h, _) in enumerate(blocks) if i % 2 == 0},
                                {h for i, (h, _) in enumerate(blocks) if i % 2 == 1})
    if pauses_expected:                                   # every folder's work exceeds a burst of 0 s
        assert len(pauses) >= len(blocks) and set(pauses) == {LISTING_PAUSE_S}
    else:
        assert pauses == []


@pytest.mark.parametrize("paced", [False, True])
def test_what_the_store_writes_and_removes_while_it_lists_is_applied_after_the_listing(tmp_path, monkeypatch, paced):
    s = store(tmp_path)
    (y, py), (z, pz), (x, px) = block(1), block(2), block(3)
    s.write(0, y, py)
    s.write(0, z, pz)
    s.write(1, z, pz)                                     # z in two files, one a group
    s.scan(full=True)
    real_names = store_module._names
    shards = len(list(s.folder.glob("??")))
    calls = []

    def names_then_change(shard: str) -> list[str]:
        listed = real_names(shard)
        calls.append(shard)
        if len(calls) == shards:                          # every folder listed: y and z were seen on disk
            s.write(0, x, px)                             # a folder the walk never visits
            s.path(0, y).write_bytes(b"torn")
            s.path(1, z).write_bytes(b"torn")
            assert s.read(0, y) is None and s.read(1, z) is None   # the store removes both files itself
        return listed

    monkeypatch.setattr(store_module, "_names", names_then_change)
    monkeypatch.setattr(store_module, "LISTING_PAUSE_S", 0.0)
    assert s.scan(full=True, paced=paced) == ({z, x}, set())
    monkeypatch.setattr(store_module, "_names", real_names)
    assert store(tmp_path).scan(full=True) == ({z, x}, set())    # what a fresh listing finds on disk
    assert s.used_bytes() == 2 * (block_file.header_size(1) + PAGE)
