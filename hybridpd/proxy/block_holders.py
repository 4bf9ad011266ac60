"""Which nodes hold each block hash: one bitmask per hash over every node index of the proxy, for routing at scale.

A routing decision asks every node for its hit on the prompt. Each node's exact answer is a fixed point over its
groups (kv_index.py), which costs a few microseconds of Python per node; at 64 nodes that alone bounded `cache_aware`
below a thousand decisions a second. But a node's hit can never pass the run of leading blocks its full-attention
groups all hold (a full-attention hit is that run, and the common hit is one every group accepts), and on
real traffic most nodes hold only the first block or two of a prompt: every conversation of the Mooncake trace
starts with the same block. So the indexes of one proxy share a `BlockHolders`: per block hash, the bitmask of the
indexes whose full-attention groups all hold it (in memory; and in memory or storage). One walk down the prompt's
chain (`held_blocks`: AND the masks until none is left) gives every node's run at once. That run is a decode node's
hit (full attention alone decides it); a prefill node's hybrid hit is at most that run, so a node whose run is
shorter than the alignment has none without being asked, and the others run their fixed point under that cap.

Each index holds one bit from `join` to `leave`; a bit is reused only after its index left and took its hashes out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hybridpd.engine.kv_cache.hashing import BlockHash


class BlockHolders:
    def __init__(self) -> None:
        self._memory: dict[bytes, int] = {}      # hash -> indexes whose full-attention groups all hold it in memory
        self._reachable: dict[bytes, int] = {}   # ... in memory or in their storage tier
        self._free: list[int] = []
        self._next_bit = 0

    def join(self) -> int:
        """A bit for a new index."""
        if self._free:
            return self._free.pop()
        self._next_bit += 1
        return self._next_bit - 1

    def leave(self, bit: int, hashes: Iterable[bytes]) -> None:
        """The index of `bit` is gone: `hashes` (every hash it set) lose the bit, and the bit may go to another index."""
        self.forget(bit, hashes)
        self._free.append(bit)

    def set(self, bit: int, block_hash: bytes, *, memory: bool, reachable: bool) -> None:
        """Whether the index of `bit` now holds `block_hash` in memory, and in memory or storage."""
        _flip(self._memory, block_hash, bit, memory)
        _flip(self._reachable, block_hash, bit, reachable)

    def forget(self, bit: int, hashes: Iterable[bytes]) -> None:
        for block_hash in hashes:
            _flip(self._memory, block_hash, bit, False)
            _flip(self._reachable, block_hash, bit, False)

    @property
    def num_hashes(self) -> int:
        return len(self._reachable)

    def held_blocks(self, chain: Sequence[BlockHash], with_storage: bool) -> dict[int, int]:
        """Per bit holding the chain's first block: how many leading blocks of `chain` its index holds (memory, or
        memory and storage together). Bits left out hold none."""
        masks = self._reachable if with_storage else self._memory
        runs: dict[int, int] = {}
        held = -1
        for position, block_hash in enumerate(chain):
            now = held & masks.get(block_hash, 0)
            dropped = (held & ~now) if position else 0
            while dropped:
                lowest = dropped & -dropped
                runs[lowest.bit_length() - 1] = position
                dropped ^= lowest
            held = now
            if not held:
                return runs
        while held > 0:
            lowest = held & -held
            runs[lowest.bit_length() - 1] = len(chain)
            held ^= lowest
        return runs


def _flip(masks: dict[bytes, int], block_hash: bytes, bit: int, on: bool) -> None:
    mask = masks.get(block_hash, 0)
    new = mask | (1 << bit) if on else mask & ~(1 << bit)
    if new == mask:
        return
    if new:
        masks[block_hash] = new
    else:
        del masks[block_hash]
