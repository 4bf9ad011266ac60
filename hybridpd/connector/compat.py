"""Can two nodes exchange KV blocks? Only if model, dtype and every group's spec agree, in the same order.

`compat_fields` names what matters as strings; `compat_hash` is a sha256 over their canonical JSON (so the
group order is covered: group keys are numbered); `describe_mismatch` names what differs in words. The model's
identity is the hash of its checkpoint's `config.json` plus a content digest of its weights, never its path: a
fine-tune of the same architecture is another model, whose KV a node must never decode from.
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


DIGEST_CACHE = ".hybridpd-weights-digest.json"
_CHUNK = 16 * 2**20


def _weight_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


def weights_digest(model_dir: Path) -> str:
    """sha256 over every `*.safetensors` file of the checkpoint (name and bytes, in name order).

    Computed once and kept beside the checkpoint in `.hybridpd-weights-digest.json`, keyed by each file's size
    and modification time: a later start reads it back unless a file changed. A read-only checkpoint directory
    is hashed at every start instead."""
    files = _weight_files(model_dir)
    stamp = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}
    cache = model_dir / DIGEST_CACHE
    try:
        kept = json.loads(cache.read_text())
        if kept.get("files") == stamp and isinstance(kept.get("sha256"), str):
            return kept["sha256"]
    except (OSError, ValueError):
        pass
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    value = digest.hexdigest()
    try:
        cache.write_text(json.dumps({"files": stamp, "sha256": value}))
    except OSError:
        pass
    return value


def model_identity(model_dir: Path) -> str:
    """`config-sha256:<16 hex> weights-sha256:<16 hex>`: equal for two copies of one checkpoint anywhere on disk,
    different for two checkpoints that differ in any weight."""
    config = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:16]
    return f"config-sha256:{config} weights-sha256:{weights_digest(model_dir)[:16]}"


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
