"""Chained, typed block hashes over token ids.

The hash of block k of a request (block size B, tokens [k*B, (k+1)*B)) covers its parent's hash, so equal hashes
mean equal prefixes. A request's salt (`cache_salt`) enters the first block only; chaining carries it on.
Each block size has its own chain: a Mamba group with interval B uses the chain of block size B, whose hash
number k-1 stands for the prefix of k*B tokens.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"


def hash_block(parent: BlockHash | None, tokens: Sequence[int], salt: bytes | None = None) -> BlockHash:
    """Hash of one full block: tagged parent, tagged length-prefixed salt, tokens as little-endian int64."""
    h = hashlib.blake2b(digest_size=32)
    h.update(_NO_PARENT if parent is None else _HAS_PARENT + parent)
    if salt is None:
        h.update(_NO_PARENT)
    else:
        h.update(_HAS_PARENT + struct.pack("<Q", len(salt)) + salt)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return BlockHash(h.digest())


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
        num_full = len(token_ids) // block_size
        for k in range(len(chain), num_full):
            parent = chain[k - 1] if k else None
            chain.append(
                hash_block(parent, token_ids[k * block_size : (k + 1) * block_size], None if k else self._salt)
            )
        return chain
