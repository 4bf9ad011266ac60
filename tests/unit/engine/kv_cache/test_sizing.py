"""Sizing from one KV budget: one request of the max model length always fits (or the node refuses to start, naming
the flags and what would fit), and the running Mamba slots are taken from the shared memory as requests are admitted:
as many requests run as the memory holds. The published 350M shape at the default budget, built on the meta device
without weights."""

from __future__ import annotations

import math

import pytest
import torch

from hybridpd.config import CacheConfig, MambaCacheMode
from hybridpd.engine.engine import DEFAULT_KV_CACHE_MEMORY
from hybridpd.engine.kv_cache.capacity import capacity_report
from hybridpd.engine.kv_cache.coordinator import KVCacheManager
from hybridpd.engine.kv_cache.memory import (
    blocks_for_memory,
    blocks_per_request,
    layout_for_memory,
    request_attention_bytes,
)
from hybridpd.engine.kv_cache.spec import FullAttentionSpec, MambaSpec, group_layers
from hybridpd.presets.shapes import SHAPES
from hybridpd.engine.model.registry import family_for

MiB = 2**20


def preset_groups(preset: str, block: int = 16):
    raw = SHAPES[preset] | {"vocab_size": 512, "eos_token_id": 0, "bos_token_id": 0}
    family = family_for(raw)
    config = family.parse_config(raw)
    with torch.device("meta"):
        model = family.build(config, torch.float32)
    return group_layers(model.kv_cache_specs(block, math.lcm(block, config.mamba_chunk_size))), config


def fits(groups, counts, max_model_len) -> bool:
    return all(n - 1 >= (1 if isinstance(g.spec, MambaSpec) else blocks_per_request(g.spec, max_model_len))
               for g, n in zip(groups, counts))


@pytest.mark.parametrize("preset", ["granite-350m", "small", "granite-moe", "nemotron-h"])
def test_every_preset_admits_a_request_of_its_max_length_at_the_default_budget(preset):
    groups, config = preset_groups(preset)
    length = config.max_position_embeddings
    layout = layout_for_memory(groups, DEFAULT_KV_CACHE_MEMORY, max_num_seqs=32, max_model_len=length)
    assert fits(groups, layout.num_blocks, length)
    report, capacity = capacity_report(groups, layout.num_blocks, length, 32, layout.shared)
    summary = report[-1]
    assert not summary.endswith(": 0x"), summary
    assert summary.endswith(f": {capacity.max_concurrency}x") and capacity.max_concurrency >= 1
    assert admitted(groups, layout, length, max_num_seqs=32) >= 1   # and it is served, not only counted


def admitted(groups, layout, length: int, *, max_num_seqs: int) -> int:
    """How many requests of `length` prompt tokens (no two alike) run side by side, admitted one after another."""
    kv = KVCacheManager(groups, layout.num_blocks, CacheConfig(block_size=16, enable_prefix_caching=False),
                        shared=layout.shared)
    running = 0
    while running < max_num_seqs:
        request = Request(f"r{running}", [running] * length)
        if kv.allocate_slots(request, length, kv.get_computed_blocks(request)) is None:
            break
        running += 1
    kv.check_invariants()
    return running


class Request:
    def __init__(self, request_id: str, tokens: list[int]) -> None:
        self.request_id, self.all_token_ids, self.num_prompt_tokens = request_id, tokens, len(tokens)
        self.cache_salt, self.skip_mamba_align = None, False


def test_the_350m_shape_runs_as_many_short_requests_as_its_memory_holds():
    """No running slot is set aside: at the default budget 576-token requests run 18 at a time (21.6 MiB of Mamba
    state and 4.5 MiB of attention each), where a split fixed at start-up gave 10 running slots."""
    groups, config = preset_groups("granite-350m")
    layout = layout_for_memory(groups, DEFAULT_KV_CACHE_MEMORY, max_num_seqs=64,
                               max_model_len=config.max_position_embeddings)
    mamba = sum(g.page_size_bytes for g in groups if isinstance(g.spec, MambaSpec))
    per_request = mamba + request_attention_bytes(groups, 576)
    assert admitted(groups, layout, 576, max_num_seqs=64) == layout.shared.capacity // per_request == 18
    fixed = blocks_for_memory(groups, DEFAULT_KV_CACHE_MEMORY, max_num_seqs=64,
                              max_model_len=config.max_position_embeddings)
    running_slots = next(n - 1 for n, g in zip(fixed, groups) if isinstance(g.spec, MambaSpec))
    assert running_slots == 10


def test_the_350m_shape_takes_its_running_slots_from_what_one_request_leaves():
    groups, config = preset_groups("granite-350m")
    length = config.max_position_embeddings   # 32,768
    with_reserve = blocks_for_memory(groups, DEFAULT_KV_CACHE_MEMORY, max_num_seqs=32, max_model_len=length)
    without = blocks_for_memory(groups, DEFAULT_KV_CACHE_MEMORY, max_num_seqs=32)
    mamba = next(i for i, g in enumerate(groups) if isinstance(g.spec, MambaSpec))
    attention = next(i for i, g in enumerate(groups) if isinstance(g.spec, FullAttentionSpec))
    assert with_reserve[mamba] < without[mamba]                 # fewer running states...
    assert with_reserve[attention] > without[attention]         # ...so that the attention holds the request
    assert not fits(groups, without, length)                    # what the node did before: a 512-token prompt failed


@pytest.mark.parametrize("memory_mib, length", [(64, 32768), (100, 16384)])
def test_a_budget_that_cannot_hold_one_request_is_refused_naming_the_flags_and_what_fits(memory_mib, length):
    groups, _ = preset_groups("granite-350m")
    with pytest.raises(ValueError) as refused:
        blocks_for_memory(groups, memory_mib * MiB, max_num_seqs=32, max_model_len=length)
    message = str(refused.value)
    assert "--kv-cache-memory" in message and "--max-model-len" in message
    need = int(message.split("at least ")[1].split("MiB")[0])
    shorter = int(message.split("--max-model-len at most ")[1])
    assert fits(groups, blocks_for_memory(groups, need * MiB, max_num_seqs=32, max_model_len=length), length)
    assert fits(groups, blocks_for_memory(groups, memory_mib * MiB, max_num_seqs=32, max_model_len=shorter), shorter)


def test_the_cached_states_never_take_the_reserved_request():
    groups, _ = preset_groups("granite-350m")
    for memory in (320, 400, 512):
        counts = blocks_for_memory(groups, memory * MiB, max_num_seqs=32, max_model_len=32768,
                                   mamba_cache_mode=MambaCacheMode.ALIGN, mamba_budget=0.5)
        assert fits(groups, counts, 32768), memory
