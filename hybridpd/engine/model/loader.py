"""Load a checkpoint directory into its family's model (registry.py), as transformers' `save_pretrained` writes it.

Weights: one `model.safetensors`, or shards listed by `model.safetensors.index.json` (its `weight_map`). Tensors of
any float dtype (bf16/fp16 as published) are converted to the compute dtype. Tied embeddings: a checkpoint may or
may not carry `lm_head.weight`; the embedding is the head either way. A tensor the model lacks, or one the model
needs and the checkpoint lacks, is an error that names it: nothing is ever left at its random initial value.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from hybridpd.engine.model.config_fields import read_checkpoint_json
from hybridpd.errors import CheckpointError
from hybridpd.engine.model.paged_lm import PagedCausalLM
from hybridpd.engine.model.registry import ModelConfig, family_for

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TIED_HEAD = "lm_head.weight"


def weight_files(model_dir: Path) -> dict[Path, tuple[str, ...] | None]:
    """Safetensors file -> the tensor names the index assigns it (None: every tensor of a single file)."""
    single, index = model_dir / WEIGHTS_FILE, model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"cannot read {index}: {exc!r}") from exc
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: weight_map must be an object of tensor name -> file")
        files: dict[Path, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(model_dir / str(file), []).append(name)
        missing = sorted(str(f.name) for f in files if not f.is_file())
        if missing:
            raise CheckpointError(f"{index} lists shards that are not in {model_dir}: {missing}")
        return {f: tuple(names) for f, names in files.items()}
    if single.is_file():
        return {single: None}
    raise CheckpointError(f"{model_dir} has neither {WEIGHTS_FILE} nor {INDEX_FILE}")


def read_weights(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, converted to `dtype`."""
    weights: dict[str, torch.Tensor] = {}
    for path, names in weight_files(model_dir).items():
        try:
            with safe_open(str(path), framework="pt") as shard:
                for name in shard.keys() if names is None else names:
                    if name in weights:
                        raise CheckpointError(f"{path}: tensor {name} appears in more than one shard")
                    weights[name] = shard.get_tensor(name).to(dtype)
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
    return weights


def read_model_config(model_dir: Path) -> tuple[ModelConfig, Callable[[torch.dtype], PagedCausalLM]]:
    """The checkpoint's config (its family's own type) and a builder of its model."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir} is not a checkpoint directory: no config.json in it")
    raw = read_checkpoint_json(path)
    try:
        family = family_for(raw)
        config = family.parse_config(raw)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    return config, lambda dtype: family.build(config, dtype)


def load_model(model_dir: Path, dtype: torch.dtype) -> tuple[ModelConfig, PagedCausalLM]:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist or is not a directory")
    config, build = read_model_config(model_dir)
    weights = read_weights(model_dir, dtype)
    model = build(dtype)
    expected = model.state_dict()
    if config.tie_word_embeddings:
        weights.pop(TIED_HEAD, None)  # tied: the embedding is the head
    needed = [k for k in expected if not (config.tie_word_embeddings and k == TIED_HEAD)]
    missing = sorted(k for k in needed if k not in weights)
    unexpected = sorted(k for k in weights if k not in expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{model_dir} does not match its config: missing tensors {_few(missing)}, unexpected tensors "
            f"{_few(unexpected)}"
        )
    for name, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{model_dir}: tensor {name} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(expected[name].shape)}"
            )
    model.load_state_dict(weights, strict=False)
    model.eval()
    return config, model


def _few(names: list[str]) -> str:
    return f"{names[:8]}{'...' if len(names) > 8 else ''}"
