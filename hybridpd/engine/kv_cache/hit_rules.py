"""Per-kind hit rules: which prefix lengths a group can serve, given which of its hashes are cached.

Pure functions of a `present(hash)` predicate, so that the engine (over its block pools) and the proxy (over the
hashes a node's KV events announced) answer with the same rule; `hit_search.find_common_hit` combines them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from hybridpd.engine.kv_cache.hashing import BlockHash

Present = Callable[[BlockHash], bool]


class HitRule(Protocol):
    block_size: int

    @property
    def downward_closed(self) -> bool:
        """True: serving L means serving every shorter aligned length."""

    def longest_hit(self, present: Present, hashes: Sequence[BlockHash], max_tokens: int, alignment: int) -> int:
        """The largest L <= max_tokens, a multiple of `alignment`, this group can serve (0 always can)."""


@dataclass(frozen=True)
class FullAttentionRule:
    """A hit is the longest run of cached blocks from the left."""

    block_size: int
    downward_closed = True

    def longest_hit(self, present: Present, hashes: Sequence[BlockHash], max_tokens: int, alignment: int) -> int:
        b = self.block_size
        limit = min(max_tokens // b, len(hashes))
        n = 0
        while n < limit and present(hashes[n]):
            n += 1
        return n * b // alignment * alignment


@dataclass(frozen=True)
class SlidingWindowRule:
    """A hit of L tokens needs only the blocks covering positions [max(0, L-W+1), L)."""

    block_size: int
    window: int
    downward_closed = False

    def first_visible_block(self, position: int) -> int:
        """The first logical block a query at `position` (or any later one) can see."""
        return max(0, position - self.window + 1) // self.block_size

    def longest_hit(self, present: Present, hashes: Sequence[BlockHash], max_tokens: int, alignment: int) -> int:
        """Right-to-left: try the largest aligned L; when block j inside its window is missing, no L with
        j*b < L can succeed (its window also contains j), so jump to align_down(j*b). Candidates only shrink and
        every block is looked up at most once, so the search is linear in the number of blocks."""
        b = self.block_size
        length = min(max_tokens, len(hashes) * b) // alignment * alignment
        while length > 0:
            first = self.first_visible_block(length)
            j = length // b - 1
            while j >= first and present(hashes[j]):
                j -= 1
            if j < first:
                return length
            length = j * b // alignment * alignment
        return 0


@dataclass(frozen=True)
class MambaRule:
    """A hit of L tokens needs the state saved after exactly L tokens (L a multiple of the interval)."""

    block_size: int
    downward_closed = False

    def longest_hit(self, present: Present, hashes: Sequence[BlockHash], max_tokens: int, alignment: int) -> int:
        length = min(max_tokens, len(hashes) * self.block_size) // alignment * alignment
        while length > 0 and not present(hashes[length // self.block_size - 1]):
            length -= alignment
        return max(length, 0)


def rule_for(kind: str, block_size: int, sliding_window: int | None = None) -> HitRule:
    """The rule of a group known only by its kind name (`KVCacheSpec.kind`, as KV events carry it: the proxy's
    index); inside a node a group's spec gives its rule (`KVCacheSpec.hit_rule`)."""
    if kind == "full_attention":
        return FullAttentionRule(block_size)
    if kind == "sliding_window":
        if sliding_window is None:
            raise ValueError("a sliding_window group needs its window")
        return SlidingWindowRule(block_size, sliding_window)
    if kind == "mamba":
        return MambaRule(block_size)
    raise ValueError(f"no hit rule for KV cache kind {kind!r}")
