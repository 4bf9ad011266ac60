"""The shapes of the built-in presets (config.json keys, as transformers writes them; `vocab_size` comes from each
preset's trained tokenizer).

- `tiny`, `small` (the default): every layer kind in a few layers — Mamba2, full attention with two KV-head counts,
  two sliding windows (the two extension keys). `tiny` spells `layer_types` as published (mamba/attention), `small`
  as transformers 5 writes it (linear_attention/full_attention).
- `small-vllm`: `small` without the extension keys (one KV-head count, no windows) and head size 32, the shape
  vLLM's CPU build can serve (benchmarks/vs_vllm.py).
- `granite-moe`: Granite-4.0-H-Tiny's shape scaled down: MoE (64 experts top 6 -> 16 top 4) with a shared MLP,
  attention in 1 layer of 10, no positional encoding ("nope"), tied embeddings, Granite's multipliers.
- `nemotron-h`: Nemotron-H's layer pattern scaled down (Mamba2, attention, MLP and MoE layers), relu2 MLPs, grouped
  expert routing with a shared expert.
- `granite-350m`: granite-4.0-h-350m's published layer pattern and widths (32 layers, attention at 10, 13, 17, 27;
  hidden 768, 12 heads / 4 KV heads of 64, 48 Mamba heads of 32, state 128, shared MLP 2048) with our tokenizer's
  vocabulary: ~265M parameters, for benchmarks where compute dominates (about 1 GB in float32; not used in tests).
"""

from __future__ import annotations

import math
from typing import Any

_GRANITE: dict[str, Any] = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "pad_token_id": None,
    "hidden_act": "silu",
    "num_local_experts": 0,
    "num_experts_per_tok": 0,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "embedding_multiplier": 4.0,
    "residual_multiplier": 0.5,
    "logits_scaling": 1.25,
    "position_embedding_type": "rope",
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "time_step_limit": [0.0, math.inf],
    "dtype": "float32",
}

_SMALL = _GRANITE | {
    "hidden_size": 128,
    "num_hidden_layers": 10,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "shared_intermediate_size": 256,
    "intermediate_size": 256,
    "attention_multiplier": 1 / math.sqrt(32),
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
    "layer_types": [
        "linear_attention", "full_attention", "linear_attention", "full_attention", "linear_attention",
        "full_attention", "linear_attention", "full_attention", "linear_attention", "full_attention",
    ],
    "kv_heads_per_layer": [None, None, None, 1, None, 1, None, None, None, None],
    "sliding_window_per_layer": [None, None, None, 64, None, None, None, 160, None, None],
    "mamba_n_heads": 4,
    "mamba_n_groups": 1,
    "mamba_d_state": 32,
    "mamba_d_head": 64,
    "mamba_chunk_size": 32,
}

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": _GRANITE | {
        "hidden_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "shared_intermediate_size": 128,
        "intermediate_size": 128,
        "attention_multiplier": 0.25,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "embedding_multiplier": 0.5,  # tied: keep the token's own embedding from dominating its logits
        "layer_types": ["mamba", "attention", "mamba", "attention", "attention", "attention"],
        "kv_heads_per_layer": [None, None, None, 1, 1, None],
        "sliding_window_per_layer": [None, None, None, 5, None, 11],
        "mamba_n_heads": 4,
        "mamba_n_groups": 2,
        "mamba_d_state": 16,
        "mamba_d_head": 32,
        "mamba_chunk_size": 8,
    },
    "small": _SMALL,
    "small-vllm": {k: v for k, v in _SMALL.items() if k not in ("kv_heads_per_layer", "sliding_window_per_layer")},
    "granite-moe": _GRANITE | {
        "hidden_size": 128,
        "num_hidden_layers": 10,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "shared_intermediate_size": 128,
        "intermediate_size": 64,
        "num_local_experts": 16,
        "num_experts_per_tok": 4,
        "attention_multiplier": 1 / 32,
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.25,
        "logits_scaling": 3.0,
        "position_embedding_type": "nope",
        "tie_word_embeddings": True,
        "layer_types": ["mamba"] * 4 + ["attention"] + ["mamba"] * 5,
        "mamba_n_heads": 8,
        "mamba_n_groups": 1,
        "mamba_d_state": 32,
        "mamba_d_head": 32,
        "mamba_chunk_size": 32,
    },
    "nemotron-h": {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hidden_size": 128,
        "hybrid_override_pattern": "M-M*-ME-M*-ME",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 256,
        "mlp_hidden_act": "relu2",
        "mamba_num_heads": 8,
        "mamba_head_dim": 32,
        "ssm_state_size": 32,
        "n_groups": 2,
        "conv_kernel": 4,
        "chunk_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "moe_shared_expert_intermediate_size": 128,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "layer_norm_epsilon": 1e-5,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "time_step_limit": [0.0, math.inf],
        "dtype": "float32",
    },
    "granite-350m": _GRANITE | {
        "hidden_size": 768,
        "num_hidden_layers": 32,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "shared_intermediate_size": 2048,
        "intermediate_size": 2048,
        "attention_multiplier": 0.015625,
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.246,
        "logits_scaling": 3.0,
        "position_embedding_type": "nope",
        "tie_word_embeddings": True,
        "max_position_embeddings": 32768,
        "layer_types": ["attention" if i in (10, 13, 17, 27) else "mamba" for i in range(32)],
        "mamba_n_heads": 48,
        "mamba_n_groups": 1,
        "mamba_d_state": 128,
        "mamba_d_head": 32,
        "mamba_chunk_size": 256,
    },
}

# the tokenizer's vocabulary per preset (the model's vocab_size: the same)
VOCAB_SIZES: dict[str, int] = {"tiny": 320, "small": 512, "small-vllm": 512, "granite-moe": 512, "nemotron-h": 512,
                               "granite-350m": 2048}
