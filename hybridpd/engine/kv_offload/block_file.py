"""One offloaded block as a file: a fixed header that says whose block it is, then the page's bytes.

The header names the model (its identity digest), the group (its layout digest), the block hash and the payload's
length and checksum; `decode` accepts a file only if every one of them matches what the reader asked for, so a torn,
truncated, foreign or corrupted file reads as a miss, never as another block's bytes.
"""

from __future__ import annotations

import hashlib
import struct

MAGIC = b"HPDKVBLK"
VERSION = 1
# magic, version, model key (32), group key (16), block hash (32), payload length, payload checksum (16)
_HEADER = struct.Struct("<8sI32s16s32sQ16s")
HEADER_SIZE = _HEADER.size


def checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def encode_header(model_key: bytes, group_key: bytes, block_hash: bytes, payload: bytes | memoryview) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, model_key, group_key, block_hash, len(payload), checksum(payload))


def decode(data: bytes | bytearray, model_key: bytes, group_key: bytes, block_hash: bytes, payload_size: int) -> memoryview | None:
    """The payload of `data` if it is exactly the block asked for, whole and intact; else None."""
    if len(data) != HEADER_SIZE + payload_size:
        return None
    magic, version, model, group, stored_hash, length, digest = _HEADER.unpack_from(data)
    if (magic, version, model, group, stored_hash, length) != (MAGIC, VERSION, model_key, group_key, block_hash,
                                                               payload_size):
        return None
    payload = memoryview(data)[HEADER_SIZE:]
    return payload if checksum(payload) == digest else None
