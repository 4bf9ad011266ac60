"""Tokens per engine step (`vllm:iteration_tokens_total`), with vLLM's buckets.

vLLM observes, per engine step, the prompt tokens it computed plus the tokens it generated (a prompt of P tokens and
M output tokens: P + M over its steps), and so does the engine.
"""

from __future__ import annotations

from hybridpd.engine.histogram import HistogramCounts, HistogramSnapshot

# vllm/v1/metrics/buckets.py: ITERATION_TOKENS_BUCKETS
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def step_token_counts() -> HistogramCounts:
    return HistogramCounts(ITERATION_TOKENS_BUCKETS)


NO_STEPS = HistogramSnapshot.empty(ITERATION_TOKENS_BUCKETS)
