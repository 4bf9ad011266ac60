"""When each request is sent: `--request-rate` with `--burstiness` (gamma-distributed gaps)."""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(
    num_requests: int, *, request_rate: float, burstiness: float, rng: np.random.Generator
) -> list[float]:
    """Send times in seconds after the start, non-decreasing, one per request.

    rate = inf: all at 0. Otherwise the gaps are Gamma(shape=burstiness, scale=1/(rate*burstiness))
    (burstiness 1 is a Poisson process; < 1 burstier, > 1 more even; inf: constant 1/rate), and,
    as in vLLM, the cumulative times are rescaled so the last one is exactly num_requests/rate:
    the offered load is then the configured one whatever the seed.
    """
    if num_requests < 1:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    cumulative = np.cumsum(gaps)
    if cumulative[-1] > 0:
        cumulative *= (num_requests / request_rate) / cumulative[-1]
    return [float(t) for t in cumulative]
