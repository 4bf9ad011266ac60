"""One offloaded block position as a file: a header that says whose block it is, then the pages of the groups that
hold it (one or more: the groups whose blocks at that hash were written behind together).

The header names the model (its identity digest), the block hash, and per page the group (its layout digest), the
payload's length and its checksum (SHA-256); `intact` accepts a file only if every one of them matches what the
reader expects for the groups the file's name lists, so a torn, truncated, foreign or corrupted file reads as a
miss, never as another block's bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

MAGIC = b"HPDKVBLK"
VERSION = 2
# magic, version, model key (32), block hash (32), number of pages
_HEAD = struct.Struct("<8sI32s32sI")
# per page: group key (16), payload length, payload checksum (16)
_PAGE = struct.Struct("<16sQ16s")


def header_size(num_pages: int) -> int:
    return _HEAD.size + num_pages * _PAGE.size


def checksum(payload: bytes | memoryview) -> bytes:
    """SHA-256, cut to 16 bytes: on the SHA extensions every current x86 and Arm server CPU has, ~1.4 GB/s here against
    BLAKE2b's ~0.5 (benchmarks/README.md), and a load checks every byte it reads."""
    return hashlib.sha256(payload).digest()[:16]


def encode_header(model_key: bytes, block_hash: bytes, pages: Sequence[tuple[bytes, bytes | memoryview]]) -> bytes:
    """The header of a file holding `pages` ((group key, payload), in the order they follow it)."""
    return _HEAD.pack(MAGIC, VERSION, model_key, block_hash, len(pages)) + b"".join(
        _PAGE.pack(group_key, len(payload), checksum(payload)) for group_key, payload in pages)


def intact(header: bytes | memoryview, payloads: Sequence[memoryview], model_key: bytes, block_hash: bytes,
           layouts: Sequence[tuple[bytes, int]]) -> bool:
    """Whether a file's `header` and `payloads` (read apart: one per layout, in order) are exactly that block of those
    groups, whole and intact."""
    if len(header) != header_size(len(layouts)) or len(payloads) != len(layouts):
        return False
    magic, version, model, stored_hash, num_pages = _HEAD.unpack_from(header)
    if (magic, version, model, stored_hash, num_pages) != (MAGIC, VERSION, model_key, block_hash, len(layouts)):
        return False
    for i, ((group_key, page_bytes), payload) in enumerate(zip(layouts, payloads)):
        key, length, digest = _PAGE.unpack_from(header, _HEAD.size + i * _PAGE.size)
        if key != group_key or length != page_bytes or payload.nbytes != page_bytes or checksum(payload) != digest:
            return False
    return True
