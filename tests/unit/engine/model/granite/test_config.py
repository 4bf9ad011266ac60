"""GraniteConfig parsing: both layer_types spellings, the extension keys, transformers' defaults, bad configs."""

from __future__ import annotations

import json
import math

import pytest

from hybridpd.engine.model.config_fields import read_config_json
from hybridpd.engine.model.granite.config import GraniteConfig, LayerKind
from hybridpd.engine.model.loader import read_model_config
from hybridpd.errors import CheckpointError
from hybridpd.engine.model.generation_config import GenerationDefaults

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
    config = GraniteConfig.from_dict(BASE | overrides)
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
    ({}, "eos_token_ids", (2,)),
    ({"eos_token_id": [7, 9]}, "eos_token_ids", (7, 9)),
    ({"eos_token_id": [7, 9]}, "eos_token_id", 7),
    ({"eos_token_id": 5}, "eos_token_ids", (5,)),
    ({"eos_token_id": None}, "eos_token_ids", ()),
    # transformers' JSON encoding of non-finite floats is decoded by read_config_json (see test_read_config_json)
    ({"time_step_limit": [0.0, float("inf")]}, "time_step_limit", (0.0, math.inf)),
    ({"rope_scaling": {"type": "default", "rope_theta": 3e4}}, "rope_theta", 3e4),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "rope_theta", 1e6),
    ({"rope_parameters": None, "rope_theta": 7e3}, "rope_theta", 7e3),
    ({"position_embedding_type": "nope"}, "position_embedding_type", None),   # published Granite-4.0-H
    ({}, "checkpoint_dtype", "float32"),
    ({"torch_dtype": "bfloat16"}, "checkpoint_dtype", "bfloat16"),
    ({"dtype": "float16"}, "checkpoint_dtype", "float16"),
    ({"dtype": "bfloat16", "torch_dtype": "float32"}, "checkpoint_dtype", "bfloat16"),
    ({}, "num_local_experts", 0),
    ({"num_local_experts": None}, "num_local_experts", 8),   # transformers' default: 8 experts, top 2
    ({"num_local_experts": 4, "num_experts_per_tok": 2}, "num_experts_per_tok", 2),
    ({"num_local_experts": 4}, "intermediate_size", 11008),
    ({"num_hidden_layers": 4.0}, "num_hidden_layers", 4),
    ({}, "tie_word_embeddings", False),
    ({}, "mamba_conv_dim", 128 + 2 * 8),
    ({"mamba_n_groups": 2}, "mamba_conv_dim", 128 + 2 * 2 * 8),
    ({}, "mamba_d_conv", 4),
    ({}, "mamba_conv_bias", True),
    ({}, "mamba_proj_bias", False),
])
def test_fields_and_defaults(overrides, field, expected):
    assert getattr(GraniteConfig.from_dict(BASE | overrides), field) == expected


@pytest.mark.parametrize("overrides, message", [
    ({"num_local_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok must be in 1..num_local_experts"),
    ({"num_local_experts": 4, "num_experts_per_tok": 0}, "num_experts_per_tok"),
    ({"num_local_experts": -1}, "num_local_experts"),
    ({"num_local_experts": "many"}, "num_local_experts must be an integer, got 'many'"),
    ({"hidden_size": 64.5}, "hidden_size must be an integer"),
    ({"dtype": "float8_e4m3fn"}, "dtype 'float8_e4m3fn' is not supported; supported: float32, bfloat16, float16"),
    ({"eos_token_id": "</s>"}, "eos_token_id must be a non-negative integer"),
    ({"eos_token_id": [2, -1]}, "eos_token_id"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type 'linear' is not supported"),
    ({"rope_parameters": "default"}, "rope_parameters must be an object"),
    ({"rope_theta": -5}, "rope_theta must be a positive number"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    ({"time_step_limit": "inf"}, "time_step_limit must be a list of two numbers"),
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
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters.rope_type 'yarn' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported; supported: 'silu'"),
    ({"architectures": ["LlamaForCausalLM"]}, "LlamaForCausalLM.*supported.*GraniteMoeHybridForCausalLM"),
    ({"time_step_limit": [0.5, 0.1]}, "time_step_limit"),
])
def test_bad_configs(overrides, message):
    with pytest.raises(ValueError, match=message):
        GraniteConfig.from_dict(BASE | overrides)


def test_from_model_dir_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        read_model_config(tmp_path)[0]
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        read_model_config(tmp_path)[0]
    (tmp_path / "config.json").write_text(json.dumps(BASE | {"hidden_act": "relu"}))
    with pytest.raises(CheckpointError, match="config.json: hidden_act 'relu'"):
        read_model_config(tmp_path)[0]
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert read_model_config(tmp_path)[0].num_hidden_layers == 4


def test_read_config_json_decodes_transformers_non_finite_floats(tmp_path):
    """transformers 5.x writes inf/nan as {"__float__": "Infinity"}; so does any config it saves."""
    raw = BASE | {"time_step_limit": [0.0, {"__float__": "Infinity"}], "x": {"__float__": "-Infinity"},
                  "nested": {"y": [{"__float__": "NaN"}]}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = read_model_config(tmp_path)[0]
    assert config.time_step_limit == (0.0, math.inf)
    decoded = read_config_json(tmp_path / "config.json")
    assert decoded["x"] == -math.inf and math.isnan(decoded["nested"]["y"][0])


@pytest.mark.parametrize("raw, expected", [
    ({}, GenerationDefaults()),
    ({"temperature": 0.6, "top_p": 0.9, "top_k": 50, "max_new_tokens": 64, "eos_token_id": [3, 4]},
     GenerationDefaults(temperature=0.6, top_p=0.9, top_k=50, max_tokens=64, eos_token_ids=(3, 4))),
    ({"eos_token_id": 7, "do_sample": False}, GenerationDefaults(eos_token_ids=(7,))),  # vLLM reads no do_sample
    ({"min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -1},
     GenerationDefaults(min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-1.0)),
])
def test_generation_defaults(raw, expected):
    assert GenerationDefaults.from_dict(raw) == expected


@pytest.mark.parametrize("raw, message", [
    ({"temperature": -1}, "temperature -1 is out of range"),
    ({"top_p": 0}, "top_p"),
    ({"max_new_tokens": "many"}, "max_new_tokens must be a number"),
    ({"eos_token_id": ["x"]}, "eos_token_id"),
    ({"repetition_penalty": 0}, "repetition_penalty 0 is out of range"),
    ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
])
def test_bad_generation_defaults(raw, message):
    with pytest.raises(ValueError, match=message):
        GenerationDefaults.from_dict(raw)
