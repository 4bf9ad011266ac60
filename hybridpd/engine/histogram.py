"""A Prometheus histogram kept by the engine thread and read by the metrics scrape from a frozen snapshot: the
engine process's collectors export families from snapshots (engine/metrics.py), never from live structures."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from prometheus_client.utils import floatToGoString


@dataclass(frozen=True)
class HistogramSnapshot:
    """Observations per bucket (the last one past the highest bound), their count and sum."""

    bounds: tuple[float, ...]
    buckets: tuple[int, ...]
    count: int = 0
    total: float = 0

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> HistogramSnapshot:
        return cls(bounds, (0,) * (len(bounds) + 1))

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus's (upper bound, observations at most that) pairs, "+Inf" last; bounds written as
        prometheus_client writes a histogram's ("1.0"), as vLLM's are."""
        out, running = [], 0
        for bound, observed in zip((*map(floatToGoString, self.bounds), "+Inf"), self.buckets):
            running += observed
            out.append((bound, running))
        return out


class HistogramCounts:
    """The running counts (`observe`, `snapshot` for the scrape)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"a histogram's bounds increase, got {bounds}")
        self.bounds = bounds
        self._buckets = [0] * (len(bounds) + 1)
        self._count = 0
        self._total: float = 0

    def observe(self, value: float) -> None:
        """One observation: in the first bucket whose bound it does not exceed."""
        self._buckets[bisect.bisect_left(self.bounds, value)] += 1
        self._count += 1
        self._total += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self._buckets), self._count, self._total)
