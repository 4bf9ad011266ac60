"""Load a checkpoint directory (`config.json` + `model.safetensors`) into a `HybridLM`."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from hybridpd.engine.model.config import CheckpointError, HybridConfig
from hybridpd.engine.model.hybrid_lm import HybridLM

WEIGHTS_FILE = "model.safetensors"


def load_model(model_dir: Path, dtype: torch.dtype) -> tuple[HybridConfig, HybridLM]:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist or is not a directory")
    config = HybridConfig.from_model_dir(model_dir)
    weights_path = model_dir / WEIGHTS_FILE
    if not weights_path.is_file():
        raise CheckpointError(f"{model_dir} has no {WEIGHTS_FILE}")
    try:
        weights = load_file(str(weights_path))
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"cannot read {weights_path}: {exc}") from exc

    model = HybridLM(config, dtype)
    expected = model.state_dict()
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # tied: the embedding is the head
    missing = sorted(k for k in expected if k not in weights and not (config.tie_word_embeddings and k == "lm_head.weight"))
    unexpected = sorted(k for k in weights if k not in expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{weights_path} does not match its config: missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}"
            f", unexpected tensors {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    for name, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{weights_path}: tensor {name} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(expected[name].shape)}"
            )
    model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=False)
    model.eval()
    return config, model
