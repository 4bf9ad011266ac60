"""What a heartbeat tells the reader about a live lease (the side channel's answer, as a typed value)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LeaseView:
    expiry: float                              # unix time
    block_ids: tuple[tuple[int, ...], ...]     # per group: exactly the blocks the reader may read
    num_tokens: int                            # the prompt tokens those blocks carry
