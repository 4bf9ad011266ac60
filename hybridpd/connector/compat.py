"""Can two nodes exchange KV blocks? Only if model, dtype and every group's spec agree, in the same order.

`compat_fields` names what matters as strings; `compat_hash` is a sha256 over their canonical JSON (so the
group order is covered: group keys are numbered); `describe_mismatch` names what differs in words. The model's
identity is the hash of its checkpoint's `config.json` contents plus the size of its weights, never its path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from hybridpd.engine.kv_cache.spec import KVCacheGroup, KVCacheSpec

_HEAD = ("model", "dtype", "num_groups")
_GROUP_PARTS = ("spec", "layers", "page bytes")


def model_identity(model_dir: Path) -> str:
    """`config-sha256:<16 hex> weights-bytes:<n>`: equal for two copies of one checkpoint anywhere on disk."""
    config = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:16]
    weights = sum(p.stat().st_size for p in sorted(model_dir.glob("*.safetensors")))
    return f"config-sha256:{config} weights-bytes:{weights}"


def _value(v: object) -> str:
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    if isinstance(v, tuple):
        return "(" + ",".join(_value(x) for x in v) + ")"
    return str(v)


def describe_spec(spec: KVCacheSpec) -> str:
    """`full_attention(block_size=16, num_kv_heads=2, head_size=8, dtype=float32)`: every field, in order."""
    fields = ", ".join(f"{f.name}={_value(getattr(spec, f.name))}" for f in dataclasses.fields(spec))
    return f"{spec.kind}({fields})"


def compat_fields(*, model: str, dtype: str, groups: Sequence[KVCacheGroup]) -> dict[str, str]:
    """`model` is `model_identity(dir)`; `dtype` the node's compute dtype; `groups` in group order."""
    fields = {"model": model, "dtype": dtype, "num_groups": str(len(groups))}
    for gid, group in enumerate(groups):
        spec, layers, page_bytes = (f"group {gid} {part}" for part in _GROUP_PARTS)
        fields[spec] = describe_spec(group.spec)
        fields[layers] = ",".join(str(layer) for layer in group.layer_ids)
        fields[page_bytes] = str(group.page_size_bytes)
    return fields


def compat_hash(fields: dict[str, str]) -> str:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _order(key: str) -> tuple[int, int, int, str]:
    """model, dtype, num_groups first; then groups by number (group 10 after group 2), spec before layers."""
    if key in _HEAD:
        return (_HEAD.index(key), 0, 0, "")
    parts = key.split(" ", 2)
    if len(parts) == 3 and parts[0] == "group" and parts[1].isdigit() and parts[2] in _GROUP_PARTS:
        return (len(_HEAD), int(parts[1]), _GROUP_PARTS.index(parts[2]), "")
    return (len(_HEAD) + 1, 0, 0, key)


def describe_mismatch(local: dict[str, str], remote: dict[str, str]) -> str:
    """`dtype differs: local float32, remote bfloat16; group 2 spec differs: local ..., remote ...`; "" if equal."""
    diffs = []
    for key in sorted(local.keys() | remote.keys(), key=_order):
        mine, theirs = local.get(key, "<absent>"), remote.get(key, "<absent>")
        if mine != theirs:
            diffs.append(f"{key} differs: local {mine}, remote {theirs}")
    return "; ".join(diffs)
