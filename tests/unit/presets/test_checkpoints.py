"""make-checkpoint writes a loadable directory; the loader's errors; the default model cache; KV specs."""

from __future__ import annotations

import argparse
import importlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridpd.cli import COMMANDS
from hybridpd.engine.kv_cache.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec, group_layers
from hybridpd.engine.model.granite.config import LayerKind
from hybridpd.errors import CheckpointError
from hybridpd.engine.model.loader import load_model
from hybridpd.presets.checkpoints import DEFAULT_PRESET, FORMAT_VERSION, PRESETS, default_model_dir, write_checkpoint


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_cli_writes_a_loadable_checkpoint(tmp_path, preset, capsys):
    """The `make-checkpoint` command, parsed and run the way hybridpd.cli does (without the other commands)."""
    command = importlib.import_module(COMMANDS["make-checkpoint"][0])
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    out = tmp_path / "ckpt"
    assert command.run(parser.parse_args(["--preset", preset, "--out", str(out)])) == 0
    assert str(out) in capsys.readouterr().out
    config, model = load_model(out, torch.float32)
    kinds = set(config.layer_kinds)
    assert kinds == {LayerKind.MAMBA, LayerKind.FULL_ATTENTION, LayerKind.SLIDING_WINDOW}
    full_kv = {kv for kv, k in zip(config.kv_heads_per_layer, config.layer_kinds) if k is LayerKind.FULL_ATTENTION}
    windows = {w for w in config.sliding_window_per_layer if w is not None}
    assert len(full_kv) == 2 and len(windows) == 2
    assert config.max_position_embeddings >= 4096
    assert config.vocab_size == PRESETS[preset]["vocab_size"] and config.eos_token_ids == (PRESETS[preset]["eos_token_id"],)


def test_default_preset_shape():
    config_raw = PRESETS[DEFAULT_PRESET]
    assert config_raw["num_hidden_layers"] >= 8
    assert config_raw["mamba_chunk_size"] in (16, 32)
    assert 128 <= config_raw["hidden_size"] <= 256


def test_checkpoint_is_deterministic(tmp_path):
    a = load_file(str(write_checkpoint("tiny", tmp_path / "a") / "model.safetensors"))
    b = load_file(str(write_checkpoint("tiny", tmp_path / "b") / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_default_model_dir_generates_once(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDPD_CACHE", str(tmp_path / "cache"))
    first = default_model_dir("tiny")
    assert first == tmp_path / "cache" / f"tiny-v{FORMAT_VERSION}"  # a cache of another format is never served
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir("tiny") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.name]  # no temporary directory left


@pytest.mark.parametrize("breakage, message", [
    ("no_dir", "does not exist"),
    ("no_weights", "neither model.safetensors nor model.safetensors.index.json"),
    ("corrupt_weights", "cannot read"),
    ("missing_tensor", "missing tensors"),
    ("wrong_shape", "has shape"),
    ("unexpected_tensor", r"unexpected tensors \['model.layers.1.self_attn.extra.weight'\]"),
    ("bad_config", r"missing tensors \['model.layers.0.block_sparse_moe"),  # an MoE config over dense weights
])
def test_loader_errors(tmp_path, breakage, message):
    model_dir = write_checkpoint("tiny", tmp_path / "ckpt")
    weights_path = model_dir / "model.safetensors"
    if breakage == "no_dir":
        model_dir = tmp_path / "nowhere"
    elif breakage == "no_weights":
        weights_path.unlink()
    elif breakage == "corrupt_weights":
        weights_path.write_bytes(b"not a safetensors file")
    elif breakage in ("missing_tensor", "wrong_shape", "unexpected_tensor"):
        weights = load_file(str(weights_path))
        name = "model.layers.1.self_attn.k_proj.weight"
        if breakage == "missing_tensor":
            del weights[name]
        elif breakage == "unexpected_tensor":
            weights["model.layers.1.self_attn.extra.weight"] = torch.zeros(2)
        else:
            weights[name] = torch.zeros(3, 3)
        save_file(weights, str(weights_path))
    else:
        raw = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps(raw | {"num_local_experts": 4, "num_experts_per_tok": 2}))
    with pytest.raises(CheckpointError, match=message):
        load_model(model_dir, torch.float32)


def test_kv_cache_specs_group_by_kind(tmp_path):
    config, model = load_model(write_checkpoint("tiny", tmp_path), torch.float32)
    specs = model.kv_cache_specs(block_size=16, mamba_interval=32)
    assert sorted(specs) == list(range(config.num_hidden_layers))
    by_kind = {type(s) for s in specs.values()}
    assert by_kind == {MambaSpec, FullAttentionSpec, SlidingWindowSpec}
    mamba = next(s for s in specs.values() if isinstance(s, MambaSpec))
    assert mamba.block_size == 32
    assert mamba.conv_state_shape == (config.mamba_d_conv - 1, config.mamba_conv_dim)
    assert mamba.ssm_state_shape == (config.mamba_n_heads, config.mamba_d_head, config.mamba_d_state)
    # tiny: one Mamba group, full attention with 2 and 1 KV heads, windows 5 (1 KV head) and 11 (2 KV heads)
    assert len(group_layers(specs)) == 5


def test_bfloat16_runs_close_to_float32(tmp_path):
    from tests.oracle.paged_runner import PagedRunner

    model_dir = write_checkpoint("tiny", tmp_path)
    ids = list(range(40, 70))
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        _, model = load_model(model_dir, dtype)
        runner = PagedRunner(model, 4, max_seqs=1, max_len=64)
        logits[dtype] = torch.cat([runner.step([(0, ids[:20])])[0], runner.step([(0, ids[20:21])])[0]])
    assert logits[torch.bfloat16].dtype == torch.float32
    assert (logits[torch.bfloat16] - logits[torch.float32]).abs().max() < 0.25
