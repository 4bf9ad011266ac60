"""Chained, typed block hashes over token ids.

The hash of block k of a request (block size B, tokens [k*B, (k+1)*B)) covers its parent's hash, so equal hashes
mean equal prefixes. A request's salt (`cache_salt`) enters the first block only; chaining carries it on.
Each block size has its own chain: a Mamba group with interval B uses the chain of block size B, whose hash
number k-1 stands for the prefix of k*B tokens.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"


def _token_bytes(tokens: Sequence[int]) -> bytes:
    packed = array("q", tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _hash_packed(parent: BlockHash | None, token_bytes: bytes, salt: bytes | None) -> BlockHash:
    head = _NO_PARENT if parent is None else _HAS_PARENT + parent
    salted = _NO_PARENT if salt is None else _HAS_PARENT + struct.pack("<Q", len(salt)) + salt
    return BlockHash(hashlib.blake2b(head + salted + token_bytes, digest_size=32).digest())


def hash_block(parent: BlockHash | None, tokens: Sequence[int], salt: bytes | None = None) -> BlockHash:
    """Hash of one full block: tagged parent, tagged length-prefixed salt, tokens as little-endian int64."""
    return _hash_packed(parent, _token_bytes(tokens), salt)


class RequestBlockHashes:
    """One request's hash chains, one per block size, each extended only over blocks not hashed yet.

    Invariant: `chain(B)[k]` is the hash of tokens [0, (k+1)*B) of the request, and the chain holds exactly
    the full blocks of the tokens it was last extended with (tokens only grow, so old entries stay valid).
    """

    def __init__(self, salt: bytes | None) -> None:
        self._salt = salt
        self._chains: dict[int, list[BlockHash]] = {}

    def chain(self, block_size: int, token_ids: Sequence[int]) -> list[BlockHash]:
        chain = self._chains.setdefault(block_size, [])
        done, num_full = len(chain), len(token_ids) // block_size
        if num_full <= done:
            return chain
        packed = _token_bytes(token_ids[done * block_size : num_full * block_size])
        width = 8 * block_size
        parent = chain[-1] if chain else None
        for k in range(done, num_full):
            offset = (k - done) * width
            parent = _hash_packed(parent, packed[offset : offset + width], None if k else self._salt)
            chain.append(parent)
        return chain
