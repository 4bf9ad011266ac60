"""Who may read a block: the model's identity and each group's layout, as the digests file paths and headers carry.

The model key covers config.json, the dtype the KV cache is kept in, the block size, and the weights: each weight
file's name, size and safetensors header (every tensor's name, dtype, shape and offsets) plus samples of its data
(64 KiB every 64 MiB, and its last 64 KiB). Reading every byte of a large checkpoint at start-up would cost seconds
per GB; two checkpoints that differ in their weights differ in every sample with overwhelming probability. The
group key covers the group's index, its spec and its layer ids, so a page is only ever read into the same layout.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

from hybridpd.engine.kv_cache.spec import KVCacheGroup

SAMPLE = 64 << 10
STRIDE = 64 << 20


def _weights_digest(model_dir: Path, digest: "hashlib._Hash") -> None:
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(path.name.encode() + struct.pack("<Q", size))
        with path.open("rb") as f:
            head = f.read(8)
            digest.update(head)
            if len(head) == 8:
                digest.update(f.read(min(struct.unpack("<Q", head)[0], size)))
            for offset in [*range(0, size, STRIDE), max(0, size - SAMPLE)]:
                f.seek(offset)
                digest.update(f.read(SAMPLE))


def model_key(model_dir: Path, kv_dtype: str, block_size: int) -> bytes:
    digest = hashlib.blake2b(digest_size=32)
    digest.update((Path(model_dir) / "config.json").read_bytes())
    digest.update(f"|{kv_dtype}|{block_size}|".encode())
    _weights_digest(model_dir, digest)
    return digest.digest()


def group_key(index: int, group: KVCacheGroup) -> bytes:
    return hashlib.blake2b(f"{index}|{group.spec!r}|{group.layer_ids}".encode(), digest_size=16).digest()
