"""How long KV blocks stay in memory and how soon they are used again: vLLM's sampled residency metrics
(`--kv-cache-metrics`, `--kv-cache-metrics-sample`), over every group's pool.

A sampled share of the blocks allocated is followed from its allocation: each prefix hit that takes it (an access;
the last four kept), and its end, when its memory goes to another block (allocated again, its hash evicted or not, or
handed back to the shared budget). At the end three histograms are observed, with vLLM's buckets: its lifetime
(allocation to end), how long it sat unused before (last access, or allocation, to end) and the gaps between its
kept accesses. As in vLLM a reset of the prefix cache forgets every followed block. These answer the sizing question
the storage tier leaves (the conversation trace's prefixes come back minutes later): how long a block outlives its
last use here, and how far apart its reuses are.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridpd.engine.histogram import HistogramCounts, HistogramSnapshot

# vllm/v1/metrics/buckets.py: KV_CACHE_RESIDENCY_BUCKETS (1 ms to 30 minutes)
RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600,
                     1200, 1800)
ACCESSES_KEPT = 4


@dataclass
class _Followed:
    born: float
    last: float
    accesses: deque[float] = field(default_factory=lambda: deque(maxlen=ACCESSES_KEPT))


@dataclass(frozen=True)
class Residency:
    """The three histograms, as the scrape reads them."""

    lifetime: HistogramSnapshot
    idle_before_evict: HistogramSnapshot
    reuse_gap: HistogramSnapshot


class BlockResidency:
    """Followed blocks by (group, block id); the engine thread calls it from the pools (`for_pool`)."""

    def __init__(self, sample_rate: float, *, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"--kv-cache-metrics-sample must be in (0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self._clock = clock
        self._rng = rng or random.Random()
        self._followed: dict[tuple[int, int], _Followed] = {}
        self._lifetime = HistogramCounts(RESIDENCY_BUCKETS)
        self._idle = HistogramCounts(RESIDENCY_BUCKETS)
        self._gaps = HistogramCounts(RESIDENCY_BUCKETS)

    def for_pool(self, group: int) -> PoolResidency:
        return PoolResidency(self, group)

    def allocated(self, key: tuple[int, int]) -> None:
        """A block taken by an allocation: the end of what it held before, and maybe the start of following it."""
        self.ended(key)
        if self._rng.random() < self.sample_rate:
            now = self._clock()
            self._followed[key] = _Followed(now, now)

    def accessed(self, key: tuple[int, int]) -> None:
        followed = self._followed.get(key)
        if followed is not None:
            followed.last = self._clock()
            followed.accesses.append(followed.last)

    def ended(self, key: tuple[int, int]) -> None:
        followed = self._followed.pop(key, None)
        if followed is None:
            return
        now = self._clock()
        self._lifetime.observe(now - followed.born)
        self._idle.observe(now - followed.last)
        kept = list(followed.accesses)
        for earlier, later in zip(kept, kept[1:]):
            self._gaps.observe(later - earlier)

    def reset(self) -> None:
        """The prefix cache was reset: nothing followed any more (no observation)."""
        self._followed.clear()

    def snapshot(self) -> Residency:
        return Residency(self._lifetime.snapshot(), self._idle.snapshot(), self._gaps.snapshot())


@dataclass(frozen=True)
class PoolResidency:
    """One group's pool's view (block ids are per pool)."""

    residency: BlockResidency
    group: int

    def allocated(self, block: int) -> None:
        self.residency.allocated((self.group, block))

    def accessed(self, block: int) -> None:
        self.residency.accessed((self.group, block))

    def ended(self, block: int) -> None:
        self.residency.ended((self.group, block))
