"""Compatibility fields, hash and the words that name a mismatch."""

from __future__ import annotations

import json

from pathlib import Path

import pytest
import torch

from hybridpd.connector.compat import compat_fields, compat_hash, describe_mismatch, model_identity
from hybridpd.engine.kv_cache.spec import FullAttentionSpec, KVCacheGroup, MambaSpec, SlidingWindowSpec

FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
FULL_4 = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=8, dtype=torch.float32)
WINDOW = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32, sliding_window=64)
MAMBA = MambaSpec(block_size=64, conv_state_shape=(3, 32), ssm_state_shape=(2, 8, 16),
                  dtypes=(torch.float32, torch.float32))
GROUPS = (KVCacheGroup(spec=MAMBA, layer_ids=(0, 2)), KVCacheGroup(spec=FULL, layer_ids=(1,)),
          KVCacheGroup(spec=WINDOW, layer_ids=(3,)))


def fields(model: str = "m1", dtype: str = "float32", groups=GROUPS) -> dict[str, str]:
    return compat_fields(model=model, dtype=dtype, groups=groups)


@pytest.mark.parametrize(
    "remote, expected",
    [
        (fields(), ""),
        (fields(dtype="bfloat16"), "dtype differs: local float32, remote bfloat16"),
        (fields(model="m2"), "model differs: local m1, remote m2"),
        (fields(groups=(GROUPS[0], KVCacheGroup(spec=FULL_4, layer_ids=(1,)), GROUPS[2])),
         "group 1 spec differs: local full_attention(block_size=16, num_kv_heads=2, head_size=8, dtype=float32), "
         "remote full_attention(block_size=16, num_kv_heads=4, head_size=8, dtype=float32); "
         "group 1 page bytes differs: local 2048, remote 4096"),
        (fields(groups=GROUPS[:2]),
         "num_groups differs: local 3, remote 2; "
         "group 2 spec differs: local sliding_window(block_size=16, num_kv_heads=2, head_size=8, dtype=float32, "
         "sliding_window=64), remote <absent>; group 2 layers differs: local 3, remote <absent>; "
         "group 2 page bytes differs: local 2048, remote <absent>"),
        (fields(groups=(GROUPS[0], KVCacheGroup(spec=FULL, layer_ids=(1, 4)), GROUPS[2])),
         "group 1 layers differs: local 1, remote 1,4; group 1 page bytes differs: local 2048, remote 4096"),
    ],
    ids=["equal", "dtype", "model", "kv-heads", "missing-group", "layers"],
)
def test_describe_mismatch(remote: dict[str, str], expected: str) -> None:
    assert describe_mismatch(fields(), remote) == expected
    assert (compat_hash(fields()) == compat_hash(remote)) == (expected == "")


def test_group_order_is_covered_by_the_hash() -> None:
    swapped = fields(groups=(GROUPS[1], GROUPS[0], GROUPS[2]))
    assert compat_hash(swapped) != compat_hash(fields())
    assert "group 0 spec differs" in describe_mismatch(fields(), swapped)


def test_mamba_spec_is_described_with_its_shapes() -> None:
    assert fields()["group 0 spec"] == (
        "mamba(block_size=64, conv_state_shape=(3,32), ssm_state_shape=(2,8,16), dtypes=(float32,float32))"
    )


def test_model_identity_ignores_the_path_but_not_the_contents(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "elsewhere" / "b", tmp_path / "c"
    for d, config, weights in [(a, b'{"x": 1}', b"w" * 10), (b, b'{"x": 1}', b"w" * 10), (c, b'{"x": 2}', b"w" * 10)]:
        d.mkdir(parents=True)
        (d / "config.json").write_bytes(config)
        (d / "model.safetensors").write_bytes(weights)
    assert model_identity(a) == model_identity(b)
    assert model_identity(a) != model_identity(c)


def test_two_checkpoints_that_differ_only_in_weights_are_different_models(tmp_path: Path) -> None:
    """A fine-tune: the same config and the same weight sizes, other values (it used to be accepted)."""
    base, tuned = tmp_path / "base", tmp_path / "tuned"
    for d, weights in [(base, b"w" * 64), (tuned, b"w" * 63 + b"v")]:
        d.mkdir()
        (d / "config.json").write_bytes(b'{"x": 1}')
        (d / "model-00001-of-00002.safetensors").write_bytes(weights)
        (d / "model-00002-of-00002.safetensors").write_bytes(b"shard two")
    assert model_identity(base) != model_identity(tuned)
    fields = [compat_fields(model=model_identity(d), dtype="float32", groups=()) for d in (base, tuned)]
    assert compat_hash(fields[0]) != compat_hash(fields[1])
    assert describe_mismatch(*fields).startswith("model differs: local config-sha256:")


def test_the_weights_digest_is_kept_beside_the_checkpoint_until_a_file_changes(tmp_path: Path) -> None:
    from hybridpd.connector.compat import DIGEST_CACHE, weights_digest

    (tmp_path / "model.safetensors").write_bytes(b"a" * 32)
    first = weights_digest(tmp_path)
    assert json.loads((tmp_path / DIGEST_CACHE).read_text())["sha256"] == first
    # the kept value is what a later start reads back (proved by planting another one under the same stamps)
    kept = json.loads((tmp_path / DIGEST_CACHE).read_text())
    (tmp_path / DIGEST_CACHE).write_text(json.dumps({**kept, "sha256": "planted"}))
    assert weights_digest(tmp_path) == "planted"
    (tmp_path / "model.safetensors").write_bytes(b"b" * 33)  # another size: computed again
    assert weights_digest(tmp_path) not in (first, "planted")
