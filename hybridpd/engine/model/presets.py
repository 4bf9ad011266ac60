"""Built-in random checkpoints (`hybridpd make-checkpoint`), and the default model generated on first use.

Both presets mix every layer kind: Mamba2, full attention with two KV-head counts, sliding windows of two
sizes. Weights come from a fixed seed, scaled so that activations stay O(1) and logits are spread (not
uniform, not one-hot). They use the byte tokenizer (no tokenizer.json): ids 0..255 are bytes, 256 = EOS,
257 = BOS. `tiny` writes the published spelling of `layer_types` (mamba/attention), `small` transformers'.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hybridpd.engine.model.config import HybridConfig
from hybridpd.engine.model.hybrid_lm import HybridLM

DEFAULT_PRESET = "small"
SEED = 1234

_COMMON: dict[str, Any] = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "vocab_size": 258,
    "eos_token_id": 256,
    "bos_token_id": 257,
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
    "torch_dtype": "float32",
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _COMMON | {
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
    "small": _COMMON | {
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
    },
}


def _random_weights(model: HybridLM, generator: torch.Generator) -> dict[str, torch.Tensor]:
    def normal(shape: torch.Size, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * std + mean

    def uniform(shape: torch.Size, low: float, high: float) -> torch.Tensor:
        return torch.rand(shape, generator=generator) * (high - low) + low

    weights = {}
    for name, param in model.state_dict().items():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("embed_tokens.weight"):
            value = normal(param.shape, 0.15)
        elif name == "lm_head.weight":
            value = normal(param.shape, 2.5 / math.sqrt(param.shape[-1]))
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            value = normal(param.shape, 0.1, mean=1.0)
        elif name.endswith("conv1d.weight"):
            value = normal(param.shape, 0.5)
        elif leaf == "bias":
            value = normal(param.shape, 0.1)
        elif leaf == "dt_bias":  # softplus(dt_bias) in [0.01, 0.2]
            dt = torch.exp(uniform(param.shape, math.log(0.01), math.log(0.2)))
            value = dt + torch.log(-torch.expm1(-dt))
        elif leaf == "A_log":
            value = torch.log(uniform(param.shape, 1.0, 8.0))
        elif leaf == "D":
            value = normal(param.shape, 0.1, mean=1.0)
        else:  # projections: fan-in scaled
            value = normal(param.shape, 1.0 / math.sqrt(param.shape[-1]))
        weights[name] = value.contiguous()
    return weights


def write_checkpoint(preset: str, out: Path) -> Path:
    """Write config.json + model.safetensors of `preset` into `out` (created if needed); return `out`."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    raw = PRESETS[preset]
    config = HybridConfig.from_dict(raw)
    model = HybridLM(config, torch.float32)
    weights = _random_weights(model, torch.Generator().manual_seed(SEED))
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return out


def default_model_dir(preset: str = DEFAULT_PRESET, cache_root: Path | None = None) -> Path:
    """The preset's checkpoint under `cache_root` ($HYBRIDPD_CACHE, else ~/.cache/hybridpd), made on first use.

    Written into a temporary sibling directory and renamed into place, so a reader never sees half a
    checkpoint; when two processes race, the loser's copy is discarded.
    """
    if cache_root is None:
        env = os.environ.get("HYBRIDPD_CACHE")
        cache_root = Path(env) if env else Path.home() / ".cache" / "hybridpd"
    target = Path(cache_root) / preset
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=target.parent))
    try:
        write_checkpoint(preset, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET, help="model shape")
    parser.add_argument("--out", type=Path, required=True, help="directory to write the checkpoint into")


def run(args: argparse.Namespace) -> int:
    out = write_checkpoint(args.preset, args.out)
    print(f"wrote the {args.preset} checkpoint to {out}")
    return 0
