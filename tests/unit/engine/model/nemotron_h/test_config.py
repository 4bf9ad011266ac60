"""NemotronHConfig parsing (transformers' reading, defaults, both layer spellings) and the family registry."""

from __future__ import annotations

import json
import math

import pytest

from hybridpd.errors import CheckpointError
from hybridpd.engine.model.loader import read_model_config
from hybridpd.engine.model.nemotron_h.config import BlockType, NemotronHConfig
from hybridpd.engine.model.registry import FAMILIES, family_for

M, A, P, E = BlockType.MAMBA, BlockType.ATTENTION, BlockType.MLP, BlockType.MOE
BASE = {
    "architectures": ["NemotronHForCausalLM"], "vocab_size": 300, "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": 4, "mamba_head_dim": 32, "ssm_state_size": 16,
    "n_groups": 2, "chunk_size": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
    "hybrid_override_pattern": "M*-E",
}


@pytest.mark.parametrize("overrides, blocks", [
    ({}, (M, A, P, E)),
    ({"layers_block_type": ["linear_attention", "full_attention", "moe", "mlp", "mamba"]}, (M, A, E, P, M)),
    ({"layers_block_type": ["mamba", "attention"]}, (M, A)),                       # legacy names
    ({"layers_block_type": ["mlp", "moe"], "hybrid_override_pattern": "MMMM"}, (P, E)),  # the list wins
    ({"hybrid_override_pattern": None}, (M, E, A, P)),                             # transformers' default
])
def test_block_types(overrides, blocks):
    config = NemotronHConfig.from_dict(BASE | overrides)
    assert config.block_types == blocks
    assert tuple(shape is not None for shape in config.attention) == tuple(b is A for b in blocks)
    assert config.has_mamba == (M in blocks)


@pytest.mark.parametrize("overrides, read, expected", [
    ({}, lambda c: c.attention[1].scale, 0.25),                     # head_dim ** -0.5, no multipliers, no RoPE
    ({}, lambda c: c.mamba.time_step_limit, (0.001, math.inf)),     # the mixer clamps below at time_step_min
    ({"time_step_min": 0.01, "time_step_limit": [0.0, 1.0]}, lambda c: c.mamba.time_step_limit, (0.01, math.inf)),
    ({"mamba_head_dim": 48}, lambda c: c.mamba.intermediate_size, 192),  # heads x head size, not expand x hidden
    ({"mamba_n_groups": 4, "n_groups": None}, lambda c: c.mamba.n_groups, 4),
    ({"layer_norm_epsilon": 1e-6}, lambda c: (c.rms_norm_eps, c.mamba.norm_eps), (1e-6, 1e-6)),
    ({}, lambda c: c.eos_token_ids, (2,)),
    ({"eos_token_id": [5, 6]}, lambda c: c.eos_token_ids, (5, 6)),
    ({}, lambda c: (c.routed_scaling_factor, c.norm_topk_prob), (1.0, True)),
    ({"kv_heads_per_layer": [None, 1, None, None], "sliding_window_per_layer": [9, 8, None, None]},
     lambda c: [(a.num_kv_heads, a.sliding_window) if a else None for a in c.attention], [None, (1, 8), None, None]),
])
def test_fields_and_defaults(overrides, read, expected):
    assert read(NemotronHConfig.from_dict(BASE | overrides)) == expected


@pytest.mark.parametrize("overrides, message", [
    ({"hybrid_override_pattern": "M*X"}, "hybrid_override_pattern 'M\\*X' is not supported"),
    ({"layers_block_type": ["mamba", "conv"]}, "unknown entries \\['conv'\\]"),
    ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act 'gelu' is not supported; supported: relu2"),
    ({"moe_latent_size": 32}, "moe_latent_size 32 is not supported"),
    ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok must be in 1..n_routed_experts"),
    ({"n_group": 3}, "n_group \\(3\\) must divide n_routed_experts"),
    ({"topk_group": 3}, "topk_group must be in 1..n_group"),
    ({"n_group": 4, "topk_group": 1}, "at least 2 experts"),
    ({"dtype": "int8"}, "dtype 'int8' is not supported"),
    ({"time_step_min": -1}, "time_step_min"),
    ({"kv_heads_per_layer": [None, 3, None, None]}, "multiple of its KV heads"),
])
def test_bad_configs(overrides, message):
    with pytest.raises(ValueError, match=message):
        NemotronHConfig.from_dict(BASE | overrides)


@pytest.mark.parametrize("raw, architecture", [
    ({"architectures": ["NemotronHForCausalLM"]}, "NemotronHForCausalLM"),
    ({"architectures": ["GraniteMoeHybridForCausalLM"]}, "GraniteMoeHybridForCausalLM"),
    ({"model_type": "nemotron_h"}, "NemotronHForCausalLM"),
    ({}, "GraniteMoeHybridForCausalLM"),
])
def test_family_for(raw, architecture):
    assert family_for(raw) is FAMILIES[architecture]


@pytest.mark.parametrize("raw, message", [
    ({"architectures": ["LlamaForCausalLM"]}, "architectures \\['LlamaForCausalLM'\\] is not supported; supported: "
                                              "\\['FalconH1ForCausalLM', 'GraniteMoeHybridForCausalLM', 'NemotronHForCausalLM'\\]"),
    ({"model_type": "llama"}, "model_type 'llama' is not supported"),
    ({"architectures": "NemotronHForCausalLM"}, "architectures must be a list"),
])
def test_family_for_refuses(raw, message):
    with pytest.raises(ValueError, match=message):
        family_for(raw)


def test_read_model_config_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE | {"mlp_hidden_act": "gelu"}))
    with pytest.raises(CheckpointError, match="config.json: mlp_hidden_act 'gelu'"):
        read_model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    config, _ = read_model_config(tmp_path)
    assert isinstance(config, NemotronHConfig)
