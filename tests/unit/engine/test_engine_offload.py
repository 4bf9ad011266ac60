"""The storage tier through the engine: a prefix that only the offload directory holds is read back and served with
the same tokens and logits as computing it; files that are gone, torn, truncated or another model's mean computing
it again, with the same tokens; a full disk drops writes and serving goes on; a read that hangs is given up after
the timeout and the prompt computed. The tiny preset has every group kind (Mamba2 at an interval, full attention
with two KV-head counts, two sliding windows), so every hit crosses all."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from hybridpd.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridpd.engine.engine import LLMEngine
from hybridpd.engine.kv_cache.events import BlockRemoved, BlockStored, Medium
from hybridpd.engine.kv_offload import block_file
from hybridpd.engine.scheduler import SchedulerPlan
from hybridpd.kv_events.groups import GroupInfo
from hybridpd.kv_events.wire import to_wire

from tests.unit.engine.engine_harness import all_free, drive, greedy, prompt

SHARED = prompt(1, 40)
FIRST = {0: [greedy("a", SHARED, 10)]}
SECOND = {0: [greedy("c", SHARED[:36] + prompt(3, 7), 6)]}


def engine(model_dir: Path, offload_dir: Path | None, rows: list | None = None) -> LLMEngine:
    def record(plan: SchedulerPlan, logits: torch.Tensor) -> None:
        samplers = [item for item in plan.scheduled if item.samples]
        rows.append({item.seq.request_id: row.clone() for item, row in zip(samplers, logits)})

    return LLMEngine(EngineConfig(
        model_dir=model_dir, cache=CacheConfig(block_size=4, num_blocks=400, kv_offload_dir=offload_dir),
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4),
    ), logits_hook=record if rows is not None else None)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """The second request computed from scratch (no tier), and the hit it gets from memory after the first."""
    rows: list = []
    computed, _ = drive(engine(tiny_dir, None, rows), SECOND)
    warm = engine(tiny_dir, None)
    drive(warm, FIRST)
    _, cached = drive(warm, SECOND)
    return computed["c"], rows, cached["c"]


def on_disk(root: Path, pattern: str = "*.kv") -> set[tuple[int, bytes]]:
    """(group, block hash) of every page the block files under `root` hold, parsed from their names."""
    held = set()
    for path in root.rglob(pattern):
        block_hash, groups = path.name.split(".")[:2]
        held.update((g, bytes.fromhex(block_hash)) for g in range(8) if int(groups, 16) >> g & 1)
    return held


def written_dir(tiny_dir: Path, root: Path) -> Path:
    first = engine(tiny_dir, root)
    drive(first, FIRST)
    first.close()
    assert first.offload.counters.written > 0 and first.offload.counters.dropped_queue_full == 0
    return root


def test_a_hit_only_storage_holds_is_served_like_computing_it(tiny_dir, tmp_path, reference):
    tokens, rows, memory_hit = reference
    root = written_dir(tiny_dir, tmp_path)
    cold_rows: list = []
    cold = engine(tiny_dir, root, cold_rows)   # a fresh process's memory: nothing cached
    out, cached = drive(cold, SECOND)
    assert memory_hit > 0 and cached["c"] == memory_hit   # the same prefix, now read from storage
    assert cold.offload.counters.loaded_blocks > 0 and cold.offload.counters.load_misses == 0
    assert cold.offload.snapshot().load_seconds.count == 1   # the one read, timed
    sources = cold.scheduler.sources   # vLLM's metrics: the disk's hit, none of it the memory's
    assert (sources.stored, sources.local_hits, sources.external_queries) == (memory_hit, 0, sources.queries)
    assert out["c"] == tokens
    sampled = [r["c"] for r in rows if "c" in r]
    cold_sampled = [r["c"] for r in cold_rows if "c" in r]
    assert len(cold_sampled) == len(sampled) == len(tokens)
    for a, b in zip(cold_sampled, sampled):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert all_free(cold)
    cold.close()


def _flip_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def _foreign_model(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[12] ^= 0x01   # a byte of the model key in the header
    path.write_bytes(bytes(data))


def _half_written(path: Path) -> None:
    path.rename(path.with_name(f".{path.name}.123.456.tmp"))   # a writer killed before its rename


@pytest.mark.parametrize("damage", [_flip_payload_byte, _truncate, _foreign_model, _half_written])
def test_bad_files_are_misses_and_the_prompt_is_computed(tiny_dir, tmp_path, reference, damage):
    tokens, _, _ = reference
    root = written_dir(tiny_dir, tmp_path)
    for path in sorted(root.rglob("*.kv")):
        damage(path)
    damaged = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    cold = engine(tiny_dir, root)
    out, cached = drive(cold, SECOND)
    cold.close()
    assert out["c"] == tokens
    assert cached["c"] == 0
    # every bad file that was read is gone (the prompt, computed again, wrote good ones in their place); bad files
    # no request read stay until one does, or until they are evicted
    misses = cold.offload.counters.load_misses
    assert misses > 0 or damage is _half_written
    still_bad = [p for p, data in damaged.items() if p.suffix == ".kv" and p.exists() and p.read_bytes() == data]
    assert len(still_bad) <= sum(p.suffix == ".kv" for p in damaged) - misses
    assert all_free(cold)


def test_a_disk_that_refuses_writes_drops_them_and_serving_goes_on(tiny_dir, tmp_path, reference):
    tokens, _, _ = reference
    full = engine(tiny_dir, tmp_path)
    for shard in range(256):   # a file where each shard folder would go: every block file's write fails (ENOTDIR)
        (full.offload.store.folder / f"{shard:02x}").touch()
    drive(full, FIRST)
    out, _ = drive(full, SECOND)
    full.close()
    assert out["c"] == tokens
    assert full.offload.counters.dropped_write_error > 0 and full.offload.counters.written == 0
    assert all_free(full)


def test_files_carry_their_checksummed_header(tiny_dir, tmp_path):
    root = written_dir(tiny_dir, tmp_path)
    path = next(root.rglob("*.kv"))
    block_hash, groups = path.name.split(".")[:2]
    header = path.read_bytes()[: block_file.header_size(int(groups, 16).bit_count())]
    assert header.startswith(block_file.MAGIC)
    assert bytes.fromhex(block_hash) in header   # the block hash the name says


def test_the_tier_reports_what_it_holds_as_kv_events_of_its_own_medium(tiny_dir, tmp_path):
    def with_events(root: Path) -> LLMEngine:
        return LLMEngine(EngineConfig(
            model_dir=tiny_dir, cache=CacheConfig(block_size=4, num_blocks=400, kv_offload_dir=root,
                                                  enable_kv_cache_events=True),
            scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4),
        ))

    writer = with_events(tmp_path)
    drive(writer, FIRST)
    writer.close()
    stored = [e for e in writer.storage_events() if isinstance(e, BlockStored)]
    assert stored and all(e.medium is Medium.STORAGE and e.token_ids == () for e in stored)
    announced = {(e.group_idx, h) for e in stored for h in e.block_hashes}
    assert len(stored) == len({e.group_idx for e in stored})   # a group's writes since the last look: one event
    assert announced == on_disk(tmp_path)
    assert all(e.medium is Medium.MEMORY for e in writer.kv.take_events())   # the memory pool's own, as before
    on_wire = to_wire(stored[0], [GroupInfo.of(i, g) for i, g in enumerate(writer.groups)])
    assert on_wire.medium == "DISK" and on_wire.group_idx == stored[0].group_idx

    restarted = with_events(tmp_path)   # what a node starts with on a shared directory is announced too
    assert {(e.group_idx, h) for e in restarted.storage_events() for h in e.block_hashes} == announced
    path = next(tmp_path.rglob("*.kv"))
    path.write_bytes(b"torn")
    ((group, block_hash), *others) = sorted(on_disk(path.parent, path.name))
    assert restarted.offload.store.read(group, block_hash) is None   # a bad file read: removed, with every group in it
    removed = restarted.storage_events()
    assert [(type(e), e.medium, e.block_hashes) for e in removed] == [
        (BlockRemoved, Medium.STORAGE, (block_hash,)) for _ in (group, *others)]
    assert {e.group_idx for e in removed} == {group, *(g for g, _ in others)}
    restarted.close()

    quiet = engine(tiny_dir, tmp_path)   # no KV events: the store keeps no changes for anyone to take
    drive(quiet, SECOND)
    quiet.close()
    assert quiet.offload.counters.written > 0 and quiet.offload.store.take_changes() == []


def test_a_read_that_hangs_is_given_up_and_the_prompt_computed(tiny_dir, tmp_path, reference):
    tokens, _, _ = reference
    root = written_dir(tiny_dir, tmp_path)
    cold = LLMEngine(EngineConfig(
        model_dir=tiny_dir, cache=CacheConfig(block_size=4, num_blocks=400, kv_offload_dir=root,
                                              kv_offload_read_timeout=0.2),
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4),
    ))
    pid = cold.offload.reader_pid
    os.kill(pid, signal.SIGSTOP)   # the directory hangs until the test ends
    try:
        out, cached = drive(cold, SECOND)
        assert out["c"] == tokens and cached["c"] == 0
        assert cold.offload.counters.load_timeouts == 1 and cold.offload.counters.loaded_blocks == 0
        assert all_free(cold)
    finally:
        os.kill(pid, signal.SIGCONT)
        cold.close()
    assert cold.offload.counters.loaded_blocks == 0   # the read came back after: nothing was copied
