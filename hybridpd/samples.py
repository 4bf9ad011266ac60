"""The `n` samples of one request body (OpenAI's API, vLLM): how many a body may ask for, and each one's seed. The
node draws them as requests of their own (server/protocol.py); the proxy splits such a body into one P/D request
per sample (proxy/samples.py). Both seed sample i with the body's seed + i, as vLLM does, so a seeded body draws the
same samples through either."""

from __future__ import annotations

MAX_N = 128   # OpenAI's bound
_INT64 = 2**64


def sample_seed(seed: int, sample: int) -> int:
    """Sample `sample`'s seed: the body's + `sample`, wrapped within int64 as the body's is."""
    return (seed + sample + _INT64 // 2) % _INT64 - _INT64 // 2
