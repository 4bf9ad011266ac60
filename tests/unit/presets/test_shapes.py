"""Presets are what transformers writes and reads: AutoConfig, AutoTokenizer and (shapes without our extension keys)
AutoModelForCausalLM load them offline, and our engine computes the same logits as transformers on them.

The default `small` and `tiny` carry the extension keys (per-layer KV heads, windows), which transformers' model
classes cannot build, so for those AutoModelForCausalLM is not asked (tests/oracle patches the reference instead).
`granite-350m` is ~1 GB of weights: its config alone is checked here.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hybridpd.engine.model.loader import load_model
from hybridpd.presets.shapes import SHAPES
from hybridpd.presets.checkpoints import PRESETS, write_checkpoint
from hybridpd.engine.model.registry import family_for
from tests.oracle.paged_runner import PagedRunner

SERVED_BY_TRANSFORMERS = ("small-vllm", "granite-moe", "nemotron-h")
TEXT = "The cache block of the hybrid model is here, and 42 tokens are café-ready!"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)


@pytest.mark.parametrize("preset", sorted(set(PRESETS) - {"granite-350m"}))
def test_preset_loads_in_transformers_and_in_ours(tmp_path, preset):
    out = write_checkpoint(preset, tmp_path / preset)
    raw = json.loads((out / "config.json").read_text())
    assert raw["time_step_limit"][1] == {"__float__": "Infinity"}  # transformers' encoding, as it writes it
    config = AutoConfig.from_pretrained(out)
    assert config.architectures == PRESETS[preset]["architectures"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token_id == PRESETS[preset]["eos_token_id"]
    ours_config, ours = load_model(out, torch.float32)
    assert ours_config.vocab_size == len(tokenizer)
    if preset not in SERVED_BY_TRANSFORMERS:
        return
    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    ids = tokenizer(TEXT)["input_ids"] * 2
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    got = PagedRunner(ours, 16, max_seqs=1, max_len=256).step([(0, ids)])[0]
    assert (got - expected).abs().max().item() < 1e-4
    assert expected[-1].softmax(-1).max() < 0.9  # logits are spread, not one-hot


def test_350m_shape_is_the_published_one():
    raw = PRESETS["granite-350m"]
    config = family_for(raw).parse_config(raw)
    attention = [i for i, attn in enumerate(config.layer_is_attention) if attn]
    assert (config.num_hidden_layers, attention, config.hidden_size) == (32, [10, 13, 17, 27], 768)
    assert (config.mamba_n_heads, config.mamba_d_head, config.mamba_d_state) == (48, 32, 128)
    params = raw["vocab_size"] * 768 + 28 * (768 * (2 * 1536 + 256 + 48) + 1536 * 768) + 4 * (768 * (768 + 2 * 256)
             + 768 * 768) + 32 * 3 * 768 * 2048
    assert 250e6 < params < 350e6
    kwargs = {k: v for k, v in raw.items() if k != "model_type"}
    assert AutoConfig.for_model("granitemoehybrid", **kwargs).num_hidden_layers == 32


def test_every_shape_has_a_preset():
    assert set(SHAPES) == set(PRESETS)
