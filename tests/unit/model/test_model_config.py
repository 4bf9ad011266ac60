"""HybridConfig parsing: both layer_types spellings, the extension keys, transformers' defaults, bad configs."""

from __future__ import annotations

import json
import math

import pytest

from hybridpd.engine.model.config import CheckpointError, HybridConfig, LayerKind

BASE = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 0,
    "shared_intermediate_size": 96,
    "position_embedding_type": "rope",
    "mamba_n_heads": 4,
    "mamba_d_state": 8,
    "mamba_chunk_size": 16,
    "layer_types": ["mamba", "attention", "attention", "attention"],
}

M, F, W = LayerKind.MAMBA, LayerKind.FULL_ATTENTION, LayerKind.SLIDING_WINDOW


@pytest.mark.parametrize("overrides, kinds, kv_heads, windows", [
    ({}, (M, F, F, F), (0, 2, 2, 2), (None, None, None, None)),
    ({"layer_types": ["linear_attention", "full_attention", "full_attention", "linear_attention"]},
     (M, F, F, M), (0, 2, 2, 0), (None, None, None, None)),
    ({"kv_heads_per_layer": [None, 1, None, 4], "sliding_window_per_layer": [None, 7, None, 32]},
     (M, W, F, W), (0, 1, 2, 4), (None, 7, None, 32)),
    ({"num_key_value_heads": None}, (M, F, F, F), (0, 4, 4, 4), (None, None, None, None)),
    # an extension entry on a Mamba layer does not make it attention
    ({"sliding_window_per_layer": [9, None, None, None]}, (M, F, F, F), (0, 2, 2, 2), (None, None, None, None)),
    ({"layer_types": None}, (M, M, M, M), (0, 0, 0, 0), (None, None, None, None)),
])
def test_layer_kinds(overrides, kinds, kv_heads, windows):
    config = HybridConfig.from_dict(BASE | overrides)
    assert config.layer_kinds == kinds
    assert config.kv_heads_per_layer == kv_heads
    assert config.sliding_window_per_layer == windows


@pytest.mark.parametrize("overrides, field, expected", [
    ({}, "mamba_d_head", 32),                  # "auto": expand * hidden / n_heads
    ({}, "head_dim", 16),
    ({"head_dim": 8}, "head_dim", 8),
    ({}, "rope_theta", 10000.0),
    ({"rope_theta": 5e5}, "rope_theta", 5e5),
    ({"rope_theta": 1.0, "rope_parameters": {"rope_type": "default", "rope_theta": 2e4}}, "rope_theta", 2e4),
    ({}, "time_step_limit", (0.0, math.inf)),
    ({"time_step_limit": [0.001, 0.1]}, "time_step_limit", (0.001, 0.1)),
    ({}, "embedding_multiplier", 1.0),
    ({"logits_scaling": 8}, "logits_scaling", 8.0),
    ({"attention_multiplier": 0.0078125}, "attention_multiplier", 0.0078125),
    ({}, "eos_token_id", 2),
    ({"eos_token_id": [7, 9]}, "eos_token_id", 7),
    ({}, "tie_word_embeddings", False),
    ({}, "mamba_conv_dim", 128 + 2 * 8),
    ({"mamba_n_groups": 2}, "mamba_conv_dim", 128 + 2 * 2 * 8),
    ({}, "mamba_d_conv", 4),
    ({}, "mamba_conv_bias", True),
    ({}, "mamba_proj_bias", False),
])
def test_fields_and_defaults(overrides, field, expected):
    assert getattr(HybridConfig.from_dict(BASE | overrides), field) == expected


@pytest.mark.parametrize("overrides, message", [
    ({"num_local_experts": 8}, "dense"),
    ({"num_local_experts": 4}, "num_local_experts: 0"),
    ({"layer_types": ["mamba", "attention"]}, "layer_types"),
    ({"layer_types": ["mamba", "attention", "moe", "attention"]}, "unknown layer_types"),
    ({"kv_heads_per_layer": [None, 3, None, None]}, "multiple of its KV heads"),
    ({"kv_heads_per_layer": [None, None]}, "kv_heads_per_layer"),
    ({"sliding_window_per_layer": [None, 0, None, None]}, "positive integers"),
    ({"sliding_window_per_layer": [None, "8", None, None]}, "positive integers"),
    ({"mamba_n_heads": 5}, "mamba_n_heads"),
    ({"mamba_d_head": 16}, "mamba_d_head"),
    ({"mamba_n_groups": 3}, "mamba_n_groups"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "default RoPE"),
    ({"hidden_act": "gelu"}, "silu"),
    ({"architectures": ["LlamaForCausalLM"]}, "GraniteMoeHybridForCausalLM"),
    ({"time_step_limit": [0.5, 0.1]}, "time_step_limit"),
])
def test_bad_configs(overrides, message):
    with pytest.raises(ValueError, match=message):
        HybridConfig.from_dict(BASE | overrides)


def test_from_model_dir_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        HybridConfig.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        HybridConfig.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(BASE | {"num_local_experts": 2}))
    with pytest.raises(CheckpointError, match="dense"):
        HybridConfig.from_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert HybridConfig.from_model_dir(tmp_path).num_hidden_layers == 4
