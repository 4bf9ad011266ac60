"""The writers' journals: lines parse back to what was written and nothing else; a reader sees each line once, whole,
from every other writer's journals (not its own), across a writer's next journal; stale journals are removed."""

from __future__ import annotations

import os
import time

import pytest

from hybridpd.engine.kv_offload import journal
from hybridpd.engine.kv_offload.journal import Change, JournalReader, JournalWriter, parse

GROUPS = 0b101


def change(i: int, added: bool = True) -> Change:
    return Change(added, GROUPS, bytes([i]) * 32)


@pytest.mark.parametrize("line, expected", [
    (change(1).line().rstrip(b"\n"), change(1)),
    (change(2, added=False).line().rstrip(b"\n"), change(2, added=False)),
    (b"*" + change(1).line()[1:].rstrip(b"\n"), None),        # not a change
    (b"+5 zz", None),                                          # not hex
    (b"+5", None),                                             # no hash
    (b"+ " + bytes([1]).hex().encode() * 32, None),            # no groups
    (b"+0 " + bytes([1]).hex().encode() * 32, None),           # no group in them
    (b"+-5 " + bytes([1]).hex().encode() * 32, None),          # what int() would take, and no writer writes
    (b"+0x5 " + bytes([1]).hex().encode() * 32, None),
    (b"+ 5 " + bytes([1]).hex().encode() * 32, None),
    (b"", None),
    (b"+", None),
])
def test_a_line_parses_back_to_the_change_or_to_nothing(line, expected):
    assert parse(line) == expected


def test_a_reader_sees_every_other_writers_lines_once_and_a_torn_one_when_whole(tmp_path):
    folder = tmp_path / "journal"
    a, b = JournalWriter(folder), JournalWriter(folder)
    reader = JournalReader(folder, a.names)               # a's own reader: passes over a's journals
    a.append([change(9)])
    b.append([change(1), change(2, added=False)])
    assert reader.read_new() == [change(1), change(2, added=False)]
    assert reader.read_new() == []
    (name,) = b.names
    line = change(3).line()
    with open(folder / name, "ab") as f:                 # a line caught half written
        f.write(line[:10])
    assert reader.read_new() == []
    with open(folder / name, "ab") as f:
        f.write(line[10:])
    assert reader.read_new() == [change(3)]


def test_a_writer_begins_a_new_journal_when_one_is_full_and_the_reader_follows(tmp_path, monkeypatch):
    monkeypatch.setattr(journal, "MAX_BYTES", 2 * len(change(0).line()))
    folder = tmp_path / "journal"
    writer, reader = JournalWriter(folder), JournalReader(folder, set())
    for i in range(5):
        writer.append([change(i)])
    assert len(writer.names) == 3
    assert sorted(reader.read_new(), key=lambda c: c.block_hash) == [change(i) for i in range(5)]


def test_an_idle_writer_begins_a_new_journal(tmp_path, monkeypatch):
    monkeypatch.setattr(journal, "IDLE_S", -1.0)            # every append comes after an idle spell
    writer = JournalWriter(tmp_path)
    writer.append([change(1)])
    writer.append([change(2)])
    assert len(writer.names) == 2


def test_stale_journals_are_removed_and_a_reader_copes(tmp_path):
    folder = tmp_path / "journal"
    old, new = JournalWriter(folder), JournalWriter(folder)
    reader = JournalReader(folder, set())
    old.append([change(1)])
    new.append([change(2)])
    (old_name,) = old.names
    stamp = time.time() - journal.KEEP_S - 1
    os.utime(folder / old_name, (stamp, stamp))
    reader.read_new()
    reader.remove_stale()
    assert sorted(os.listdir(folder)) == sorted(new.names)
    new.append([change(3)])
    assert reader.read_new() == [change(3)]
