"""What the proxy knows of one node's prefix cache: per group, the hashes its KV events announced.

Applying a node's events in order leaves exactly the hashes each of its groups can serve (engine/kv_cache/events.py),
so the hit the node will find for a prompt is the engine's own fixed point (`find_common_hit`) over these sets with
the engine's own per-kind rules (`hit_rules`): no second copy of either.
- `decode_hit`: the longest prefix every full-attention group holds. A decode node skips Mamba alignment for a
  remotely prefilled prompt, so that is exactly its local hit.
- `prefill_hit`: the hybrid hit over every group (full attention, each window, Mamba states at their interval).
Both are capped at `num_prompt_tokens - 1`, as the engine caps them (the last prompt token is always computed).
Events of the storage tier (medium "DISK") go to a set of their own per group: `*_hit(..., with_storage=True)` is
the same rule over memory and storage together, as the engine searches both.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from hybridpd.engine.kv_cache.hashing import BlockHash, RequestBlockHashes
from hybridpd.engine.kv_cache.hit_rules import HitRule, rule_for
from hybridpd.engine.kv_cache.hit_search import find_common_hit
from hybridpd.kv_events import wire
from hybridpd.kv_events.wire import GroupInfo


@dataclass
class _IndexedGroup:
    """One group as `find_common_hit` asks it: its rule over the hashes the node announced (memory, and with
    `with_storage` storage too)."""

    info: GroupInfo
    rule: HitRule
    hashes: set[bytes]
    stored: set[bytes] = field(default_factory=set)
    with_storage: bool = False

    def present(self, block_hash: bytes) -> bool:
        return block_hash in self.hashes or (self.with_storage and block_hash in self.stored)

    @property
    def block_size(self) -> int:
        return self.info.block_size

    @property
    def downward_closed(self) -> bool:
        return self.rule.downward_closed

    def longest_hit(self, chain: Sequence[BlockHash], max_tokens: int, alignment: int) -> int:
        present = self.present if self.with_storage else self.hashes.__contains__
        return self.rule.longest_hit(present, chain, max_tokens, alignment)


class PromptHashes:
    """One prompt's hash chains, one per block size, computed once and shared by every node's index."""

    def __init__(self, token_ids: Sequence[int], cache_salt: bytes | None) -> None:
        self.token_ids = token_ids
        self._store = RequestBlockHashes(cache_salt)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def chain(self, block_size: int) -> list[BlockHash]:
        return self._store.chain(block_size, self.token_ids)


class NodeIndex:
    def __init__(self, groups: Iterable[GroupInfo]) -> None:
        self._groups = [
            _IndexedGroup(g, rule_for(g.kind, g.block_size, g.sliding_window), set()) for g in groups
        ]

    @property
    def groups(self) -> tuple[GroupInfo, ...]:
        return tuple(g.info for g in self._groups)

    @property
    def num_hashes(self) -> int:
        return sum(len(g.hashes) for g in self._groups)

    def hashes(self, group_idx: int) -> frozenset[bytes]:
        return frozenset(self._groups[group_idx].hashes)

    def clear(self) -> None:
        """Forget everything (the node's feed starts over)."""
        for g in self._groups:
            g.hashes.clear()
            g.stored.clear()

    def apply(self, events: Iterable[wire.KVCacheEvent]) -> None:
        """Apply a batch in order. An event for a group this node does not have is a protocol error (ValueError)."""
        for event in events:
            if isinstance(event, wire.AllBlocksCleared):   # the memory pool was reset; storage keeps its files
                for g in self._groups:
                    g.hashes.clear()
                continue
            group = self._group(event.group_idx)
            target = group.stored if event.medium == wire.MEDIUM_STORAGE else group.hashes
            if isinstance(event, wire.BlockStored):
                target.update(_as_bytes(h) for h in event.block_hashes)
            else:
                target.difference_update(_as_bytes(h) for h in event.block_hashes)

    def _group(self, group_idx: int | None) -> _IndexedGroup:
        if group_idx is None or not 0 <= group_idx < len(self._groups):
            raise ValueError(f"a KV event for group {group_idx}, the node has {len(self._groups)} groups")
        return self._groups[group_idx]

    def decode_hit(self, prompt: PromptHashes, with_storage: bool = False) -> int:
        return self._hit(prompt, [g for g in self._groups if g.info.kind == "full_attention"], with_storage)

    def prefill_hit(self, prompt: PromptHashes, with_storage: bool = False) -> int:
        return self._hit(prompt, self._groups, with_storage)

    @property
    def has_storage(self) -> bool:
        return any(g.stored for g in self._groups)

    @staticmethod
    def _hit(prompt: PromptHashes, groups: Sequence[_IndexedGroup], with_storage: bool) -> int:
        if not groups or prompt.num_tokens <= 1:
            return 0
        if with_storage:
            groups = [replace(g, with_storage=True) for g in groups]
        chains = [prompt.chain(g.block_size) for g in groups]
        return find_common_hit(groups, chains, prompt.num_tokens - 1)


def _as_bytes(block_hash: bytes | int) -> bytes:
    if isinstance(block_hash, int):  # vLLM's int form (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES); ours are bytes
        raise ValueError("integer block hashes cannot be matched against prompts; the node must publish bytes")
    return block_hash
