"""A node compiles the decode attention for its model's head shapes when its engine starts, not at the first decode
step (where a machine that never ran the shape would wait ~2 s for the compiler): every attention layer's (head
size, query heads per KV head) on one thread, and nothing on more, where decode rows go to SDPA instead."""

from __future__ import annotations

import pytest
import torch

from hybridpd.config import CacheConfig, EngineConfig
from hybridpd.engine.engine import LLMEngine
from hybridpd.engine.model.kernels import decode_attention
from hybridpd.engine.model.layers.attention import Attention


@pytest.mark.parametrize("threads", [1, 2])
def test_the_engine_prepares_every_attention_shape_at_start(tiny_dir, monkeypatch, threads):
    prepared: list[tuple[int, int]] = []
    monkeypatch.setattr(decode_attention, "prepare", lambda dim, group: prepared.append((dim, group)))
    before = torch.get_num_threads()
    try:
        engine = LLMEngine(EngineConfig(model_dir=tiny_dir, threads=threads,
                                        cache=CacheConfig(block_size=4, num_blocks=32)))
    finally:
        torch.set_num_threads(before)
    layers = [m for m in engine.model.modules() if isinstance(m, Attention)]
    assert len({(m.head_dim, m.num_heads // m.num_kv_heads) for m in layers}) >= 2   # the tiny preset's kinds
    want = [(m.head_dim, m.num_heads // m.num_kv_heads) for m in layers] if threads == 1 else []
    assert sorted(prepared) == sorted(want)
