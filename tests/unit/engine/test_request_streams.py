"""RequestStreams: the consumer side of an engine that runs elsewhere (a thread, the node's engine process).

The engine here is a recorder: what `submit` and `abort` were called with; the test plays the engine's answers
through the OutputSink methods, from another thread where the real engine would call them.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from hybridpd.engine.request import FinishReason, RequestOutput
from hybridpd.engine.request_streams import RequestStreams
from hybridpd.errors import EngineDeadError, InvalidRequestError, ServerOverloadedError

DEADLINE_S = 10


def output(request_id: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id=request_id, new_token_ids=(token,), new_text=str(token), num_prompt_tokens=3,
                         num_cached_tokens=0, num_output_tokens=token, finished=finished,
                         finish_reason=FinishReason.LENGTH if finished else None)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def submit(self, request_id: str):
        return lambda: self.calls.append(("submit", request_id))

    def abort(self, request_id: str):
        return lambda: self.calls.append(("abort", request_id))


def from_thread(fn, *args) -> None:
    """Call an OutputSink method from another thread, as the engine does."""
    thread = threading.Thread(target=fn, args=args)
    thread.start()
    thread.join()


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


@pytest.fixture
async def streams():
    s = RequestStreams()
    s.bind(asyncio.get_running_loop())
    return s


async def test_outputs_arrive_in_order_and_end_at_the_finished_one(streams):
    engine = Recorder()
    stream = streams.stream("a", engine.submit("a"), engine.abort("a"))
    first = asyncio.ensure_future(anext(stream))
    await settle()
    assert engine.calls == [("submit", "a")]
    from_thread(streams.deliver, [output("a", 1), output("b", 9), output("a", 2)])
    from_thread(streams.deliver, [output("a", 3, finished=True)])
    got = [await asyncio.wait_for(first, DEADLINE_S)] + [o async for o in stream]
    assert [o.num_output_tokens for o in got] == [1, 2, 3]
    assert engine.calls == [("submit", "a")]          # finished: nothing to abort
    assert len(streams) == 0


async def test_a_consumer_that_leaves_early_aborts_and_holds_the_id_until_the_engine_has(streams):
    engine = Recorder()
    stream = streams.stream("a", engine.submit("a"), engine.abort("a"))
    pending = asyncio.ensure_future(anext(stream))
    from_thread(streams.deliver, [output("a", 1)])
    await asyncio.wait_for(pending, DEADLINE_S)
    await stream.aclose()
    assert engine.calls == [("submit", "a"), ("abort", "a")]
    with pytest.raises(ServerOverloadedError, match="already in flight"):
        await anext(streams.stream("a", engine.submit("a"), engine.abort("a")))
    from_thread(streams.deliver, [output("a", 2, finished=True)])   # the old request's late output: for nobody
    from_thread(streams.aborted, "a")
    await settle()
    again = streams.stream("a", engine.submit("a"), engine.abort("a"))
    pending = asyncio.ensure_future(anext(again))
    await settle()
    from_thread(streams.deliver, [output("a", 7, finished=True)])
    assert (await asyncio.wait_for(pending, DEADLINE_S)).num_output_tokens == 7


async def test_a_rejection_is_raised_at_the_first_output_and_frees_the_id_at_once(streams):
    engine = Recorder()
    stream = streams.stream("a", engine.submit("a"), engine.abort("a"))
    pending = asyncio.ensure_future(anext(stream))
    await settle()
    from_thread(streams.rejected, "a", InvalidRequestError("too long", param="prompt"))
    with pytest.raises(InvalidRequestError, match="too long"):
        await asyncio.wait_for(pending, DEADLINE_S)
    assert engine.calls == [("submit", "a")]          # the engine holds nothing: no abort
    assert len(streams) == 0
    ok = streams.stream("a", engine.submit("a"), engine.abort("a"))
    pending = asyncio.ensure_future(anext(ok))
    await settle()
    from_thread(streams.deliver, [output("a", 1, finished=True)])
    assert (await asyncio.wait_for(pending, DEADLINE_S)).finished


async def test_a_dead_engine_ends_every_stream_with_an_error_output(streams):
    engine = Recorder()
    firsts = []
    for rid in ("a", "b"):
        firsts.append(asyncio.ensure_future(anext(streams.stream(rid, engine.submit(rid), engine.abort(rid)))))
    await settle()
    from_thread(streams.died, RuntimeError("boom"))
    for first in firsts:
        out = await asyncio.wait_for(first, DEADLINE_S)
        assert out.finished and out.finish_reason is FinishReason.ERROR
        assert isinstance(out.error, EngineDeadError) and "boom" in str(out.error)


async def test_a_submit_that_fails_leaves_the_id_free(streams):
    def broken() -> None:
        raise EngineDeadError("the engine process is gone")

    with pytest.raises(EngineDeadError):
        await anext(streams.stream("a", broken, Recorder().abort("a")))
    assert len(streams) == 0
    engine = Recorder()
    pending = asyncio.ensure_future(anext(streams.stream("a", engine.submit("a"), engine.abort("a"))))
    await settle()
    assert engine.calls == [("submit", "a")]
    pending.cancel()
