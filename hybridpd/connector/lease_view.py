"""What a heartbeat tells the reader about a live lease (the side channel's answer, as a typed value)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def prompt_digest(token_ids: Sequence[int]) -> bytes:
    """sha256 of token ids (as little-endian int64): ties a lease to the prompt whose KV it holds."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).digest()


@dataclass(frozen=True, kw_only=True)
class LeaseView:
    expiry: float                              # unix time
    block_ids: tuple[tuple[int, ...], ...]     # per group: exactly the blocks the reader may read
    num_tokens: int                            # the prompt tokens those blocks carry
    prompt_digest: bytes = b""                 # `prompt_digest` of those tokens
    seconds_left: float = 0.0                  # of the lease when the owner answered (0: unknown, e.g. an older peer)
