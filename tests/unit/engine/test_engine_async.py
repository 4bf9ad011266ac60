"""AsyncEngine: the engine thread driven from asyncio; early close aborts, shutdown aborts the rest.

Checks of the engine's state run on the engine thread (`on_engine`), so they never race a step.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import pytest

from hybridpd.engine.async_engine import AsyncEngine
from hybridpd.engine.request import FinishReason
from hybridpd.errors import InvalidRequestError, ServerOverloadedError

from .engine_harness import all_free, greedy, make_engine, run, text_prompt, token_ids

PROMPT = text_prompt("Once upon a time, in a land")
LONG = 1000     # max_tokens for requests that must still be running when something else happens
DEADLINE_S = 60


async def on_engine(engine: AsyncEngine, fn: Callable[[], Any]) -> Any:
    """Run `fn` on the engine thread between two steps (after everything posted before it) and return its value."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def call() -> None:
        try:
            value = fn()
        except BaseException as exc:  # handed back to the test
            loop.call_soon_threadsafe(future.set_exception, exc)
        else:
            loop.call_soon_threadsafe(future.set_result, value)

    engine.call_soon(call)
    return await asyncio.wait_for(future, DEADLINE_S)


@pytest.fixture
async def engine(tiny_dir):
    engine = AsyncEngine(make_engine(tiny_dir, num_blocks=300), "tiny")
    engine.start()
    try:
        yield engine
    finally:
        await asyncio.wait_for(engine.shutdown(0), DEADLINE_S)


async def collect(engine: AsyncEngine, request) -> list:
    return [out async for out in engine.generate(request)]


async def test_generate_streams_the_same_tokens_as_the_sync_engine(engine, tiny_dir):
    outputs = await asyncio.wait_for(collect(engine, greedy("a", PROMPT, max_tokens=6)), DEADLINE_S)
    assert [out.finished for out in outputs] == [False] * 5 + [True]
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    sync = make_engine(tiny_dir)
    sync.add_request(greedy("a", PROMPT, max_tokens=6))
    assert token_ids(outputs) == token_ids(run(sync)["a"])
    assert await on_engine(engine, lambda: all_free(engine.engine))
    assert engine.num_active_requests == 0


async def test_concurrent_requests(engine):
    results = await asyncio.wait_for(asyncio.gather(
        *(collect(engine, greedy(f"r{i}", PROMPT[i:], max_tokens=3 + i)) for i in range(4))), DEADLINE_S)
    assert [len(token_ids(outs)) for outs in results] == [3, 4, 5, 6]
    assert await on_engine(engine, lambda: all_free(engine.engine))


async def test_closing_the_generator_early_aborts(engine):
    stream = engine.generate(greedy("a", PROMPT, max_tokens=LONG))
    first = await asyncio.wait_for(anext(stream), DEADLINE_S)
    assert not first.finished
    await stream.aclose()
    assert engine.num_active_requests == 0
    assert await on_engine(engine, lambda: engine.engine.scheduler.num_unfinished()) == 0
    assert await on_engine(engine, lambda: all_free(engine.engine))


async def test_a_request_id_in_flight_is_rejected(engine):
    stream = engine.generate(greedy("dup", PROMPT, max_tokens=LONG))
    await asyncio.wait_for(anext(stream), DEADLINE_S)
    with pytest.raises(ServerOverloadedError, match="already in flight"):
        await anext(engine.generate(greedy("dup", PROMPT, max_tokens=2)))
    await stream.aclose()
    with pytest.raises(ServerOverloadedError, match="already in flight"):   # until the engine has aborted it
        await anext(engine.generate(greedy("dup", PROMPT, max_tokens=2)))
    await on_engine(engine, lambda: None)                      # the abort ran before this, and was reported
    again = await asyncio.wait_for(collect(engine, greedy("dup", PROMPT, max_tokens=2)), DEADLINE_S)
    assert again[-1].finish_reason is FinishReason.LENGTH      # its own outputs, not the old request's abort
    assert len(token_ids(again)) == 2
    assert await on_engine(engine, lambda: all_free(engine.engine))


async def test_invalid_requests_fail_before_reaching_the_engine(engine):
    with pytest.raises(InvalidRequestError):
        await anext(engine.generate(greedy("bad", ())))
    assert engine.num_active_requests == 0


@pytest.mark.parametrize("grace", [0.0, 0.01])
async def test_shutdown_aborts_what_is_still_running(tiny_dir, grace):
    engine = AsyncEngine(make_engine(tiny_dir, num_blocks=300), "tiny")
    engine.start()
    try:
        streams = [engine.generate(greedy(f"r{i}", PROMPT, max_tokens=LONG)) for i in range(2)]
        for stream in streams:
            await asyncio.wait_for(anext(stream), DEADLINE_S)   # both are running
        rest = [asyncio.ensure_future(drain(stream)) for stream in streams]
        await asyncio.wait_for(engine.shutdown(grace), DEADLINE_S)
        finals = await asyncio.wait_for(asyncio.gather(*rest), DEADLINE_S)
    finally:
        await asyncio.wait_for(engine.shutdown(0), DEADLINE_S)
    assert [f.finish_reason for f in finals] == [FinishReason.ABORT] * 2
    assert not engine.healthy()
    assert all_free(engine.engine)                               # the engine thread has stopped: safe to read
    with pytest.raises(ServerOverloadedError, match="shutting down"):
        await anext(engine.generate(greedy("late", PROMPT)))


async def test_shutdown_lets_short_requests_finish_within_the_grace(tiny_dir):
    engine = AsyncEngine(make_engine(tiny_dir, num_blocks=300), "tiny")
    engine.start()
    try:
        stream = engine.generate(greedy("a", PROMPT, max_tokens=4))
        await asyncio.wait_for(anext(stream), DEADLINE_S)
        rest = asyncio.ensure_future(drain(stream))
        await asyncio.wait_for(engine.shutdown(DEADLINE_S), DEADLINE_S * 2)
        final = await asyncio.wait_for(rest, DEADLINE_S)
    finally:
        await asyncio.wait_for(engine.shutdown(0), DEADLINE_S)
    assert final.finish_reason is FinishReason.LENGTH and final.num_output_tokens == 4
    assert all_free(engine.engine)


async def drain(stream):
    last = None
    async for out in stream:
        last = out
    return last


async def test_the_engine_thread_runs_on_the_cpus_it_is_given(tiny_dir):
    """`--engine-cpus`: the engine thread (not the event loop's) is pinned before its first step."""
    before = os.sched_getaffinity(0)
    cpu = min(before)
    engine = AsyncEngine(make_engine(tiny_dir, cpus=frozenset({cpu})), "tiny")
    engine.start()
    try:
        assert await on_engine(engine, lambda: os.sched_getaffinity(0)) == {cpu}
        outputs = await asyncio.wait_for(collect(engine, greedy("a", PROMPT, max_tokens=2)), DEADLINE_S)
        assert outputs[-1].finished
    finally:
        await asyncio.wait_for(engine.shutdown(0), DEADLINE_S)
    assert os.sched_getaffinity(0) == before   # the calling thread is left as it was
