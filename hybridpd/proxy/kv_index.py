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
Indexes built with a shared `BlockHolders` (block_holders.py) keep it told of the hashes all their full-attention
groups hold, and read each node's run of leading blocks from one walk for every node: that run is the decode hit,
and it caps the prefill hit (a node whose run is shorter than the prompt's alignment has none without its fixed point
being run).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from hybridpd.engine.kv_cache.hashing import BlockHash, RequestBlockHashes
from hybridpd.engine.kv_cache.hit_rules import HitRule, rule_for
from hybridpd.engine.kv_cache.hit_search import find_common_hit
from hybridpd.kv_events import wire
from hybridpd.kv_events.wire import GroupInfo
from hybridpd.proxy.block_holders import BlockHolders


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
    """One prompt's hash chains, one per block size, computed once and shared by every node's index; likewise the
    runs of leading blocks each node holds (`held_blocks`)."""

    def __init__(self, token_ids: Sequence[int], cache_salt: bytes | None) -> None:
        self.token_ids = token_ids
        self._store = RequestBlockHashes(cache_salt)
        self._held: dict[tuple[BlockHolders, int, bool], dict[int, int]] = {}
        self._last_held: tuple[BlockHolders, int, bool, dict[int, int]] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def chain(self, block_size: int) -> list[BlockHash]:
        return self._store.chain(block_size, self.token_ids)

    def held_blocks(self, holders: BlockHolders, block_size: int, with_storage: bool) -> dict[int, int]:
        """`holders.held_blocks` of this prompt's chain, walked once per decision and read by every node's index."""
        last = self._last_held
        if last is not None and last[0] is holders and last[1] == block_size and last[2] is with_storage:
            return last[3]
        key = (holders, block_size, with_storage)
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = holders.held_blocks(self.chain(block_size), with_storage)
        self._last_held = (holders, block_size, with_storage, held)
        return held


class NodeIndex:
    def __init__(self, groups: Iterable[GroupInfo], holders: BlockHolders | None = None) -> None:
        self._groups = [
            _IndexedGroup(g, rule_for(g.kind, g.block_size, g.sliding_window), set()) for g in groups
        ]
        self._stored_view = [replace(g, with_storage=True) for g in self._groups]   # the same sets, read together
        full = [i for i, g in enumerate(self._groups) if g.info.kind == "full_attention"]
        self._full_attention = [self._groups[i] for i in full]
        self._full_attention_stored = [self._stored_view[i] for i in full]
        sizes = {g.block_size for g in self._full_attention}
        self._run_block = sizes.pop() if len(sizes) == 1 else None   # the block of the runs in `holders`
        self._holders = holders if self._run_block is not None else None
        self._bit = self._holders.join() if self._holders is not None else None
        self.has_storage = False   # whether its storage tier announced anything (read at every decision)

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
        if self._holders is not None and self._bit is not None:
            self._holders.forget(self._bit, self._full_attention_hashes())
        for g in self._groups:
            g.hashes.clear()
            g.stored.clear()
        self.has_storage = False

    def close(self) -> None:
        """The index is dropped: its bit in the shared holders is given back (call once, last)."""
        if self._holders is not None and self._bit is not None:
            self._holders.leave(self._bit, self._full_attention_hashes())
            self._bit = None

    def _full_attention_hashes(self) -> set[bytes]:
        return set().union(*(g.hashes for g in self._full_attention), *(g.stored for g in self._full_attention))

    def _tell_holders(self, hashes: Iterable[bytes]) -> None:
        """`hashes` may have changed in a full-attention group: where every such group holds each now."""
        if self._holders is None or self._bit is None:
            return
        groups = self._full_attention
        for h in hashes:
            memory = all(h in g.hashes for g in groups)
            reachable = memory or all(h in g.hashes or h in g.stored for g in groups)
            self._holders.set(self._bit, h, memory=memory, reachable=reachable)

    def apply(self, events: Iterable[wire.KVCacheEvent]) -> None:
        """Apply a batch in order. An event for a group this node does not have is a protocol error (ValueError)."""
        for event in events:
            if isinstance(event, wire.AllBlocksCleared):   # the memory pool was reset; storage keeps its files
                cleared = set().union(*(g.hashes for g in self._full_attention))
                for g in self._groups:
                    g.hashes.clear()
                self._tell_holders(cleared)
                continue
            group = self._group(event.group_idx)
            target = group.stored if event.medium == wire.MEDIUM_STORAGE else group.hashes
            hashes = [_as_bytes(h) for h in event.block_hashes]
            if isinstance(event, wire.BlockStored):
                target.update(hashes)
            else:
                target.difference_update(hashes)
            if group.info.kind == "full_attention":
                self._tell_holders(hashes)
        self.has_storage = any(g.stored for g in self._groups)

    def _group(self, group_idx: int | None) -> _IndexedGroup:
        if group_idx is None or not 0 <= group_idx < len(self._groups):
            raise ValueError(f"a KV event for group {group_idx}, the node has {len(self._groups)} groups")
        return self._groups[group_idx]

    def decode_hit(self, prompt: PromptHashes, with_storage: bool = False) -> int:
        if self._bit is not None:   # the run every full-attention group holds is the hit (asked of every node)
            block = self._run_block
            return _run_hit(prompt.held_blocks(self._holders, block, with_storage).get(self._bit, 0), block,
                            len(prompt.token_ids) - 1)
        return self._hit(prompt, self._full_attention_stored if with_storage else self._full_attention, with_storage)

    def prefill_hit(self, prompt: PromptHashes, with_storage: bool = False) -> int:
        return self._hit(prompt, self._stored_view if with_storage else self._groups, with_storage)

    def _hit(self, prompt: PromptHashes, groups: Sequence[_IndexedGroup], with_storage: bool) -> int:
        cap = len(prompt.token_ids) - 1
        if not groups or cap <= 0:
            return 0
        if self._bit is not None:
            block = self._run_block
            held = prompt.held_blocks(self._holders, block, with_storage).get(self._bit, 0)
            cap = min(cap, held * block)   # every full-attention group holds this run, and no hit passes it
            if cap < block:
                return 0
        chains = [prompt.chain(g.block_size) for g in groups]
        return find_common_hit(groups, chains, cap)

    @staticmethod
    def hits_of(indexes: Sequence[NodeIndex | None], prompt: PromptHashes, *, prefill: bool) -> list[int | None]:
        """`prefill_hit` (or `decode_hit`) of each index in memory, None where there is no index: the same answers,
        with the walk the indexes share read once for all of them. A node whose run is empty has no hit of either
        kind; a decode hit is its run; a prefill node holding a run runs its own fixed point under it."""
        cap = len(prompt.token_ids) - 1
        hits: list[int | None] = []
        holders, block, held = None, 0, {}
        for index in indexes:
            if index is None:
                hits.append(None)
                continue
            bit = index._bit
            if bit is None:
                hits.append(index.prefill_hit(prompt) if prefill else index.decode_hit(prompt))
                continue
            if index._holders is not holders or index._run_block != block:
                holders, block = index._holders, index._run_block
                held = prompt.held_blocks(holders, block, False)
            run = held.get(bit, 0)
            if not run:
                hits.append(0)
            else:
                hits.append(index.prefill_hit(prompt) if prefill else _run_hit(run, block, cap))
        return hits


def _run_hit(run: int, block: int, cap: int) -> int:
    """A decode hit from a run of `run` leading blocks all full-attention groups hold, capped as the engine caps it
    (`cap`: the prompt's tokens but the last, which is always computed; in whole blocks)."""
    held = run * block
    return (held if held <= cap else cap // block * block) if cap > 0 else 0


def _as_bytes(block_hash: bytes | int) -> bytes:
    if isinstance(block_hash, int):  # vLLM's int form (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES); ours are bytes
        raise ValueError("integer block hashes cannot be matched against prompts; the node must publish bytes")
    return block_hash
