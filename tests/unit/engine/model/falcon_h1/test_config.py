"""FalconH1Config parsing: transformers' defaults, the μP multipliers, how Mamba's output meets its gate, bad configs."""

from __future__ import annotations

import json

import pytest

from hybridpd.engine.model.falcon_h1.config import FalconH1Config
from hybridpd.engine.model.loader import read_model_config
from hybridpd.engine.model.shapes import MambaNorm
from hybridpd.errors import CheckpointError

BASE = {
    "architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1", "vocab_size": 300, "hidden_size": 64,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 96, "mamba_d_ssm": 128, "mamba_n_heads": 4, "mamba_d_state": 16, "mamba_n_groups": 2,
    "mamba_chunk_size": 8,
}


@pytest.mark.parametrize("overrides, read, expected", [
    ({}, lambda c: c.mamba.d_head, 32),                                     # "auto": d_ssm / n_heads
    ({"mamba_d_ssm": None, "mamba_expand": 2}, lambda c: c.mamba.intermediate_size, 128),  # expand x hidden
    ({}, lambda c: c.attention.scale, 0.25),                                # head_dim ** -0.5
    ({"head_dim": None}, lambda c: c.attention.head_dim, 16),               # hidden / heads
    ({"num_key_value_heads": None}, lambda c: c.attention.num_kv_heads, 4),
    ({}, lambda c: c.mamba.norm, MambaNorm.GATE_ONLY),                     # transformers' default: no norm
    ({"mamba_rms_norm": True}, lambda c: c.mamba.norm, MambaNorm.NORM_THEN_GATE),  # norm_before_gate defaults true
    ({"mamba_rms_norm": True, "mamba_norm_before_gate": False}, lambda c: c.mamba.norm, MambaNorm.GATED),
    ({}, lambda c: (c.mamba.in_proj_multipliers, c.mlp_multipliers), ((1.0,) * 5, (1.0, 1.0))),
    ({"ssm_multipliers": [0.5, 1, 2, 3, 4], "mlp_multipliers": [1.5, 0.25]},
     lambda c: (c.mamba.in_proj_multipliers, c.mlp_multipliers), ((0.5, 1.0, 2.0, 3.0, 4.0), (1.5, 0.25))),
    ({"key_multiplier": 0.3, "lm_head_multiplier": 0.1}, lambda c: (c.attention.key_multiplier, c.lm_head_multiplier),
     (0.3, 0.1)),
    ({"mamba_proj_bias": True}, lambda c: (c.mamba.in_proj_bias, c.mamba.out_proj_bias), (True, False)),
    ({"projectors_bias": True}, lambda c: (c.mamba.in_proj_bias, c.mamba.out_proj_bias), (False, True)),
    ({"rope_theta": 1e11}, lambda c: c.rope_theta, 1e11),
    ({"eos_token_id": [5, 6]}, lambda c: c.eos_token_ids, (5, 6)),
])
def test_fields_and_defaults(overrides, read, expected):
    assert read(FalconH1Config.from_dict(BASE | overrides)) == expected


@pytest.mark.parametrize("overrides, message", [
    ({"mamba_d_head": 24}, "mamba_d_head \\* mamba_n_heads \\(24 \\* 4\\) must equal mamba_d_ssm \\(128\\)"),
    ({"mamba_n_heads": 3}, "mamba_n_heads \\(3\\) must divide mamba_d_ssm \\(128\\)"),
    ({"ssm_multipliers": [1, 2]}, "ssm_multipliers must be a list of 5 numbers"),
    ({"mlp_multipliers": "big"}, "mlp_multipliers must be a list of 2 numbers"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"num_key_value_heads": 3}, "multiple of its KV heads"),
    ({"mamba_n_groups": 3}, "mamba_n_groups \\(3\\) must divide"),
    ({"head_dim": 15}, "RoPE needs an even head_dim"),
])
def test_bad_configs_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        FalconH1Config.from_dict(BASE | overrides)


def test_the_registry_reads_it_from_a_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert isinstance(read_model_config(tmp_path)[0], FalconH1Config)
    (tmp_path / "config.json").write_text(json.dumps(BASE | {"ssm_multipliers": [1]}))
    with pytest.raises(CheckpointError, match="config.json: ssm_multipliers"):
        read_model_config(tmp_path)
