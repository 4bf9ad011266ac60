"""Tokens per engine step as a histogram with vLLM's buckets (`vllm:iteration_tokens_total`), kept by the engine
thread and read by the metrics scrape from a frozen snapshot.

vLLM observes, per engine step, the prompt tokens it computed plus the tokens it generated (a prompt of P tokens and
M output tokens: P + M over its steps), and so does the engine.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from prometheus_client.utils import floatToGoString

# vllm/v1/metrics/buckets.py: ITERATION_TOKENS_BUCKETS
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class StepTokens:
    """Steps per bucket (the last one past the highest bound), and the steps' count and sum."""

    buckets: tuple[int, ...] = (0,) * (len(ITERATION_TOKENS_BUCKETS) + 1)
    count: int = 0
    total: int = 0

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus's (upper bound, steps at most that) pairs, "+Inf" last; bounds written as prometheus_client
        writes a histogram's ("1.0"), as vLLM's are."""
        out, running = [], 0
        for bound, steps in zip((*map(floatToGoString, ITERATION_TOKENS_BUCKETS), "+Inf"), self.buckets):
            running += steps
            out.append((bound, running))
        return out


class StepTokenCounter:
    """The engine thread's running counts (`observe` a step, `snapshot` for the scrape)."""

    def __init__(self) -> None:
        self._buckets = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self._count = 0
        self._total = 0

    def observe(self, tokens: int) -> None:
        self._buckets[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, tokens)] += 1
        self._count += 1
        self._total += tokens

    def snapshot(self) -> StepTokens:
        return StepTokens(tuple(self._buckets), self._count, self._total)
