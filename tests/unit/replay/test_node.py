"""The simulated node against a real engine: the same requests, one after another, give the same hit per request
and leave the same cached block hashes in every group (full attention, windows, Mamba states), block for block; with
a storage tier, the simulated directory holds the blocks the engine's writes, and a fresh node over it finds the
same hits (memory and storage together) as a fresh engine over the real one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridpd.bench import mooncake
from hybridpd.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridpd.engine.engine import LLMEngine
from hybridpd.engine.request import EngineRequest
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.presets.checkpoints import write_checkpoint
from hybridpd.replay.node import NodeLayout, SimNode
from hybridpd.replay.storage import SimStorage

MEMORY = 3 << 20
MAX_LEN = 512
SEQS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    return write_checkpoint("tiny", tmp_path_factory.mktemp("tiny"))


def trace_prompts() -> list[list[int]]:
    """Conversation-like: later turns extend earlier ones, other sessions interleave (ids as in a Mooncake trace)."""
    records = [mooncake.TraceRecord(timestamp_ms=i, input_length=length, output_length=4, hash_ids=ids)
               for i, (length, ids) in enumerate([
                   (2048, (0, 1, 2, 3)), (3000, (0, 1, 2, 3, 4, 5)), (1500, (0, 9, 10)), (4000, (0, 1, 2, 3, 4, 5, 6, 7)),
                   (900, (11, 12)), (3500, (0, 1, 2, 3, 4, 5, 6)), (2600, (0, 9, 10, 13, 14, 15)), (1000, (11, 12))])]
    rng = np.random.Generator(np.random.PCG64(3))
    return [list(mooncake.prompt_tokens(r, 32, 256, rng)) for r in records]


def test_the_simulated_node_caches_what_the_engine_caches(tiny):
    engine = LLMEngine(EngineConfig(
        model_dir=tiny, cache=CacheConfig(block_size=16, kv_cache_memory=MEMORY),
        scheduler=SchedulerConfig(max_num_seqs=SEQS, max_num_batched_tokens=2048, max_model_len=MAX_LEN),
    ))
    node = SimNode("sim", NodeLayout.of(tiny, MEMORY, 16, SEQS, MAX_LEN))
    assert node.layout.num_blocks == engine.num_blocks
    for i, prompt in enumerate(trace_prompts()):
        outputs, cached = _serve(engine, i, prompt)
        assert node.colocated(f"r{i}", prompt, outputs).cached_tokens == cached, f"request {i}"
        for g in range(len(engine.groups)):
            assert node.kv.cached_hashes(g) == engine.kv.cached_hashes(g), f"request {i}, group {g}"
    assert cached > 0   # the trace's sharing was hit


def _serve(engine: LLMEngine, i: int, prompt: list[int]) -> tuple[list[int], int | None]:
    """Request `r{i}` to its end, alone: its outputs and its cached tokens."""
    engine.add_request(EngineRequest(request_id=f"r{i}", prompt_token_ids=tuple(prompt),
                                     sampling=SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)))
    outputs, cached = [], None
    while engine.has_work():
        for out in engine.step():
            outputs.extend(out.new_token_ids)
            cached = out.num_cached_tokens
    return outputs, cached


def _run(engine: LLMEngine, prompts: list[tuple[int, list[int]]]) -> dict[int, tuple[list[int], int | None]]:
    """Each prompt to the end, one after another, its writes on disk before the next starts (the simulated tier
    writes at once): its outputs and its cached tokens."""
    done = {}
    for i, prompt in prompts:
        done[i] = _serve(engine, i, prompt)
        assert engine.offload is not None and engine.offload.wait_written(30.0)
    return done


def test_the_simulated_storage_tier_holds_and_serves_what_the_real_one_does(tiny, tmp_path):
    def engine() -> LLMEngine:
        return LLMEngine(EngineConfig(
            model_dir=tiny, cache=CacheConfig(block_size=16, kv_cache_memory=MEMORY, kv_offload_dir=tmp_path),
            scheduler=SchedulerConfig(max_num_seqs=SEQS, max_num_batched_tokens=2048, max_model_len=MAX_LEN),
        ))

    layout = NodeLayout.of(tiny, MEMORY, 16, SEQS, MAX_LEN)
    storage = SimStorage([g.spec.page_size_bytes for g in layout.groups], 1 << 30)
    prompts = list(enumerate(trace_prompts()))
    writer, node = engine(), SimNode("sim", layout, storage=storage)
    first = _run(writer, prompts)
    writer.close()   # what was queued reaches the disk
    for i, prompt in prompts:
        assert node.colocated(f"r{i}", prompt, first[i][0]).cached_tokens == first[i][1], f"request {i}"
    assert writer.offload.counters.written == storage.blocks_written > 0
    assert writer.offload.counters.dropped_queue_full == writer.offload.counters.dropped_write_error == 0

    reader, fresh = engine(), SimNode("fresh", layout, storage=storage)   # fresh memory, the same directory
    served = []
    for i, prompt in reversed(prompts):
        outputs, cached = _run(reader, [(i, prompt)])[i]
        served.append(fresh.colocated(f"r{i}", prompt, outputs))
        assert served[-1].cached_tokens == cached, f"request {i}"
    reader.close()
    assert sum(s.storage_tokens for s in served) > 0 and storage.blocks_read > 0   # hits came from storage
