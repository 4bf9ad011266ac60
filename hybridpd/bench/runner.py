"""Send the prompts on their schedule over one session, at most `max_concurrency` at a time."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from hybridpd.bench.client import EndpointTarget, RequestOutput, send_request
from hybridpd.bench.datasets import SampleRequest


@dataclass(frozen=True, kw_only=True)
class RunOutcome:
    outputs: tuple[RequestOutput, ...]   # in the order of the samples
    duration_s: float                    # first send scheduled -> last request done


async def run_requests(
    session: aiohttp.ClientSession,
    target: EndpointTarget,
    samples: Sequence[SampleRequest],
    *,
    offsets_s: Sequence[float],
    max_concurrency: int | None,
    disable_tqdm: bool,
) -> RunOutcome:
    """Each sample is released at its offset after the start, then waits for a concurrency slot.

    The duration runs from the start to the last answer, so throughputs include the pacing, as in vLLM.
    """
    if len(offsets_s) != len(samples):
        raise ValueError(f"{len(samples)} samples but {len(offsets_s)} arrival offsets")
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    progress = tqdm(total=len(samples), disable=disable_tqdm)

    async def one(sample: SampleRequest) -> RequestOutput:
        async with slots:
            output = await send_request(session, target, sample)
        progress.update(1)
        return output

    start = time.perf_counter()
    tasks = []
    try:
        for sample, offset in zip(samples, offsets_s):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # pacing the arrivals is the point here
            tasks.append(asyncio.create_task(one(sample)))
        outputs = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        progress.close()
    return RunOutcome(outputs=tuple(outputs), duration_s=time.perf_counter() - start)
