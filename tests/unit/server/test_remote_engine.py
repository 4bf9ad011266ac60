"""RemoteEngine over a real socket pair, with the engine process played by a thread that speaks the engine link:
outputs reach their request in order, a rejection is raised at the first output, an early close sends Abort and
holds the id until the engine answers Aborted, /metrics text comes back by nonce, Drain answers Drained, and an
engine that goes away fails what is in flight."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from multiprocessing.connection import Connection

import pytest

from hybridpd.engine.model.generation_config import GenerationDefaults
from hybridpd.engine.request import EngineRequest, FinishReason, RequestOutput
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.errors import EngineDeadError, InvalidRequestError, ServerOverloadedError
from hybridpd.server.engine_link import (
    Abort,
    Aborted,
    Drain,
    Drained,
    EngineFailed,
    EngineInfo,
    LinkEnd,
    MetricsText,
    Outputs,
    Rejected,
    ResetPrefixCache,
    ScrapeMetrics,
    Submit,
)
from hybridpd.server.remote_engine import RemoteEngine

DEADLINE_S = 10
INFO = EngineInfo(engine_id="hybridpd-test", max_model_len=512, vocab_size=300,
                  generation_defaults=GenerationDefaults(), groups=(), side_channel_port=1)


def request(rid: str, max_tokens: int = 2) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=(1, 2, 3),
                         sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0))


def output(rid: str, n: int, finished: bool) -> RequestOutput:
    return RequestOutput(request_id=rid, new_token_ids=(n,), new_text=str(n), num_prompt_tokens=3,
                         num_cached_tokens=0, num_output_tokens=n, finished=finished,
                         finish_reason=FinishReason.LENGTH if finished else None)


class FakeEngineProcess:
    """Answers like the engine process: a Submit gets its outputs (or a rejection for an empty prompt); an Abort
    gets Aborted; a "hold" request gets one output and then waits for its Abort."""

    def __init__(self, link: LinkEnd) -> None:
        self.link = link
        self.received: list[object] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                message = self.link.recv()
                self.received.append(message)
                if isinstance(message, Submit):
                    rid = message.request.request_id
                    if rid.startswith("bad"):
                        self.link.send(Rejected(rid, InvalidRequestError("prompt too long", param="prompt")))
                    elif rid.startswith("hold"):
                        self.link.send(Outputs([output(rid, 1, False)]))
                    else:
                        self.link.send(Outputs([output(rid, 1, False)]))
                        self.link.send(Outputs([output(rid, 2, True)]))
                elif isinstance(message, Abort):
                    self.link.send(Aborted(message.request_id))
                elif isinstance(message, ScrapeMetrics):
                    self.link.send(MetricsText(message.nonce, b"hybridpd:num_requests_running 0.0\n"))
                elif isinstance(message, Drain):
                    self.link.send(Drained(released=3))
                elif message == "die":
                    self.link.send(EngineFailed("boom"))
        except (EOFError, OSError):
            pass


@pytest.fixture
async def pair():
    front, engine = socket.socketpair()
    front_link, engine_link = (LinkEnd(Connection(os.dup(s.fileno()))) for s in (front, engine))
    fake = FakeEngineProcess(engine_link)
    remote = RemoteEngine(front_link, INFO, "tiny", tokenizer=None)  # type: ignore[arg-type]
    remote.start()
    try:
        yield remote, fake
    finally:
        for s in (front, engine):  # wakes both readers with EOF, as a process's exit does
            s.shutdown(socket.SHUT_RDWR)
        fake.thread.join(DEADLINE_S)
        assert not fake.thread.is_alive()
        for closable in (front_link, engine_link, front, engine):
            closable.close()


async def collect(remote: RemoteEngine, rid: str) -> list[RequestOutput]:
    return [out async for out in remote.generate(request(rid))]


async def test_outputs_reach_their_request_in_order(pair):
    remote, _ = pair
    a, b = await asyncio.wait_for(asyncio.gather(collect(remote, "a"), collect(remote, "b")), DEADLINE_S)
    assert [o.num_output_tokens for o in a] == [1, 2] and a[-1].finished
    assert [o.request_id for o in b] == ["b", "b"]
    assert remote.num_active_requests == 0 and remote.healthy()


async def test_a_rejection_is_raised_at_the_first_output_with_its_type(pair):
    remote, _ = pair
    with pytest.raises(InvalidRequestError, match="too long") as caught:
        await asyncio.wait_for(anext(remote.generate(request("bad-1"))), DEADLINE_S)
    assert caught.value.param == "prompt"
    assert remote.num_active_requests == 0


async def test_closing_early_aborts_and_the_id_is_busy_until_aborted(pair):
    remote, fake = pair
    stream = remote.generate(request("hold-1", max_tokens=100))
    await asyncio.wait_for(anext(stream), DEADLINE_S)
    await stream.aclose()
    with pytest.raises(ServerOverloadedError):
        await anext(remote.generate(request("hold-1")))
    for _ in range(DEADLINE_S * 100):  # until the fake's Aborted is back
        if any(isinstance(m, Abort) for m in fake.received) and remote.num_active_requests == 0:
            try:
                first = await asyncio.wait_for(anext(remote.generate(request("hold-1"))), DEADLINE_S)
                break
            except ServerOverloadedError:
                pass
        await asyncio.sleep(0.01)
    else:
        pytest.fail("the id stayed busy after the engine aborted it")
    assert first.request_id == "hold-1"


async def test_metrics_reset_and_drain_cross_the_link(pair):
    remote, fake = pair
    text = await asyncio.wait_for(remote.metrics_text(), DEADLINE_S)
    assert text == b"hybridpd:num_requests_running 0.0\n"
    remote.reset_prefix_cache()
    assert await asyncio.wait_for(remote.drain(1.0), DEADLINE_S) == 3
    assert any(isinstance(m, ResetPrefixCache) for m in fake.received)


async def test_a_failed_engine_ends_streams_and_reports_unhealthy(pair):
    remote, _ = pair
    stream = remote.generate(request("hold-2", max_tokens=100))
    await asyncio.wait_for(anext(stream), DEADLINE_S)
    remote._send("die")  # the fake's cue to report its engine thread dead
    last = await asyncio.wait_for(anext(stream), DEADLINE_S)
    assert last.finished and last.finish_reason is FinishReason.ERROR and isinstance(last.error, EngineDeadError)
    assert not remote.healthy()
    with pytest.raises(EngineDeadError):
        remote.generate(request("late"))
