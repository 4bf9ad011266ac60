"""Reading a checkpoint's config.json as transformers reads it, and the fields every family parses the same way."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hybridpd.errors import CheckpointError


def _decode_non_finite(obj: dict[str, Any]) -> Any:
    """transformers writes inf/nan as `{"__float__": "Infinity"}` (strict JSON has no such number)."""
    if obj.keys() == {"__float__"}:
        return float(obj["__float__"])
    return obj


def read_config_json(path: Path) -> Any:
    """A config.json or generation_config.json as transformers reads it (non-finite floats decoded)."""
    return json.loads(Path(path).read_text(), object_hook=_decode_non_finite)


def read_checkpoint_json(path: Path) -> dict[str, Any]:
    """A checkpoint's JSON object (config.json, generation_config.json), as transformers reads it; a file that is
    unreadable, not JSON or not an object is a CheckpointError naming it."""
    try:
        raw = read_config_json(path)
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return raw


SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


def int_field(raw: dict[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return int(value)


def parse_eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id", 2)
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(f"eos_token_id must be a non-negative integer or a list of them, got {eos!r}")
    return tuple(dict.fromkeys(ids))


def checkpoint_dtype(model_dir: Path) -> str:
    """The dtype a checkpoint's weights were saved in, from its config.json (float32 when it cannot say: the
    engine's own reading of the checkpoint reports what is wrong with it)."""
    try:
        raw = read_config_json(Path(model_dir) / "config.json")
        return parse_dtype(raw) if isinstance(raw, dict) else "float32"
    except (OSError, ValueError):
        return "float32"


def parse_dtype(raw: dict[str, Any]) -> str:
    value = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    value = value.removeprefix("torch.") if isinstance(value, str) else value
    if value not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {value!r} is not supported; supported: {', '.join(SUPPORTED_DTYPES)}")
    return value


def float_or_one(raw: dict[str, Any], key: str) -> float:
    value = raw.get(key, 1.0)
    return 1.0 if value is None else float(value)


def per_layer_list(raw: dict[str, Any], key: str, num_layers: int) -> list[Any]:
    values = raw.get(key)
    if values is None:
        return [None] * num_layers
    if not isinstance(values, list) or len(values) != num_layers:
        raise ValueError(f"{key} must be a list of num_hidden_layers ({num_layers}) entries, got {values}")
    for v in values:
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{key} entries must be positive integers or null, got {v!r}")
    return values


def rope_theta(raw: dict[str, Any]) -> float:
    """`rope_parameters` (or legacy `rope_scaling`) first, then a top-level `rope_theta`, then 10000."""
    key = "rope_parameters" if raw.get("rope_parameters") is not None else "rope_scaling"
    params = raw.get(key) or {}
    if not isinstance(params, dict):
        raise ValueError(f"{key} must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{key}.rope_type {rope_type!r} is not supported; supported: 'default'")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor {partial!r} is not supported; supported: 1.0 (the whole head)")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ValueError(f"rope_theta must be a positive number, got {theta!r}")
    return float(theta)


def time_step_limit(raw: dict[str, Any]) -> tuple[float, float]:
    """Mamba2's clamp of dt: `time_step_limit` as two numbers (null or absent: no clamp)."""
    limit = raw.get("time_step_limit", (0.0, math.inf))
    if limit is not None and (not isinstance(limit, (list, tuple)) or len(limit) != 2
                              or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in limit)):
        raise ValueError(f"time_step_limit must be a list of two numbers, got {limit!r}")
    return (0.0, math.inf) if limit is None else (float(limit[0]), float(limit[1]))


def token_and_dtype_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The fields every family's config reads alike: `tie_word_embeddings`, `bos_token_id`, `eos_token_ids` (every
    id of a list) and `checkpoint_dtype`."""
    return {
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "bos_token_id": raw.get("bos_token_id", 1),
        "eos_token_ids": parse_eos_ids(raw),
        "checkpoint_dtype": parse_dtype(raw),
    }
