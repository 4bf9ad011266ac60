"""A body asking for `n` > 1 samples, through the proxy: one P/D request per sample (`n` 1, the body's seed + i), the
answers merged into the one a node gives such a body: choice i from sample i, one id, the prompt counted once; in a
stream, every sample's chunks at its index as they come, one usage chunk and one [DONE]; failures end every
sample. First through fake nodes, then the merging alone against scripted samples (failures at each point, bytes
arriving in any split, a client that leaves)."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from hybridpd.proxy.samples import merge_samples

from .fake_node import REJECT_BODY, Behavior


def _events(raw: bytes) -> list:
    out = []
    for block in raw.decode().split("\n\n")[:-1]:
        data = block.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _prefill_calls(h):
    return [r for r in h.prefill[0].received if (r.body.get("kv_transfer_params") or {}).get("do_remote_decode")]


async def test_n_samples_are_p_d_requests_of_their_own_with_seeds_merged_into_one_answer(make_harness):
    h = await make_harness([Behavior.OK], [Behavior.OK])
    body = {"prompt": "hi", "max_tokens": 5, "n": 3, "seed": 5}
    async with h.session.post(h.url + "/v1/completions", json=body, headers={"X-Request-Id": "r1"}) as resp:
        assert resp.status == 200 and resp.headers["X-Request-Id"] == "r1"
        out = await resp.json()
    prefills, decodes = _prefill_calls(h), h.decode[0].received
    assert sorted(r.body["seed"] for r in prefills) == [5, 6, 7] and all(r.body["n"] == 1 for r in prefills)
    assert sorted(r.body["seed"] for r in decodes) == [5, 6, 7]
    assert all(r.body["kv_transfer_params"]["do_remote_prefill"] for r in decodes)   # each sample pulled
    assert [(c["index"], c["text"]) for c in out["choices"]] == [(0, "seed=5"), (1, "seed=6"), (2, "seed=7")]
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}
    assert out["kv_transfer_params"] is None


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
async def test_a_stream_of_samples_interleaves_them_under_one_id(make_harness, path, body):
    h = await make_harness([Behavior.OK], [Behavior.OK])
    body = body | {"max_tokens": 4, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    async with h.session.post(h.url + path, json=body) as resp:
        assert resp.status == 200
        events = _events(await resp.read())
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks, usage = events[:-2], events[-2]
    assert len({c["id"] for c in events[:-1]}) == 1
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        if path.endswith("chat/completions"):
            assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        texts = [c.get("text", c.get("delta", {}).get("content", "")) for c in mine]
        assert "".join(texts).endswith("Hello!")
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 6,
                                                         "total_tokens": 11}
    assert len(_prefill_calls(h)) == 2 and len(h.decode[0].received) == 2


async def test_the_first_samples_refusal_is_the_answer_and_no_other_sample_starts(make_harness):
    h = await make_harness([Behavior.REJECT], [Behavior.OK])
    async with h.session.post(h.url + "/v1/completions", json={"prompt": "hi", "n": 4, "stream": True}) as resp:
        assert resp.status == 400 and await resp.read() == REJECT_BODY
    assert len(h.prefill[0].received) == 1 and h.decode[0].received == []


async def test_an_answer_refused_refuses_the_body(make_harness):
    h = await make_harness([Behavior.OK], [Behavior.REJECT])
    async with h.session.post(h.url + "/v1/completions", json={"prompt": "hi", "n": 2}) as resp:
        assert resp.status == 400 and await resp.read() == REJECT_BODY


@pytest.mark.parametrize("n", [1, 0, 129, "2", 2.0, True])
async def test_a_body_that_is_not_several_samples_goes_as_it_is(make_harness, n):
    h = await make_harness([Behavior.OK], [Behavior.OK])
    async with h.session.post(h.url + "/v1/completions", json={"prompt": "hi", "n": n}) as resp:
        assert resp.status == 200
    assert [r.body["n"] for r in h.prefill[0].received] == [n]   # the node refuses what it must


# The merging alone, against scripted samples.

def _chunk(index_text: str, last: bool = False) -> bytes:
    choice = {"index": 0, "text": index_text, "finish_reason": "length" if last else None}
    return b"data: " + json.dumps({"id": f"cmpl-{index_text}", "created": 1, "object": "text_completion",
                                   "model": "m", "choices": [choice]}).encode() + b"\n\n"


class Scripted:
    """Sample i writes script[i] (bytes, or an exception to raise / a web.Response to answer before opening)."""

    def __init__(self, script):
        self.script = script
        self.cancelled: list[int] = []
        self.started: list[int] = []

    async def route(self, reply, body, request_id):
        index = int(request_id.rsplit("-", 1)[1])
        self.started.append(index)
        steps = self.script[index]
        try:
            if isinstance(steps, web.Response):
                return steps
            await reply.open(200, {})
            for step in steps:
                if step is None:
                    await asyncio.Event().wait()   # hangs until cancelled
                await reply.write(step)
                await asyncio.sleep(0)
            return await reply.close()
        except asyncio.CancelledError:
            self.cancelled.append(index)
            raise


async def _merged(script, n=None, stream=True):
    scripted = Scripted(script)
    n = n or len(script)

    async def handler(request):
        return await merge_samples(request, [{"stream": stream, "n": 1}] * n, "r", scripted.route)

    app = web.Application()
    app.router.add_post("/", handler)
    async with TestClient(TestServer(app)) as client:
        resp = await client.post("/", json={})
        return resp.status, await resp.read(), scripted


async def test_bytes_split_anywhere_merge_the_same():
    events = [_chunk("a"), _chunk("b", last=True), b"data: [DONE]\n\n"]
    whole = b"".join(events)
    bytewise = [whole[i:i + 1] for i in range(len(whole))]
    _, merged_whole, _ = await _merged([events, [_chunk("c", last=True), b"data: [DONE]\n\n"]])
    _, merged_bytes, _ = await _merged([bytewise, [_chunk("c", last=True), b"data: [DONE]\n\n"]])
    for merged in (merged_whole, merged_bytes):
        events = _events(merged)
        assert events[-1] == "[DONE]" and len({c["id"] for c in events[:-1]}) == 1
        assert [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in events[:-1]
                if c["choices"][0]["index"] == 0] == [(0, "a"), (0, "b")]
        assert [c["choices"][0]["text"] for c in events[:-1] if c["choices"][0]["index"] == 1] == ["c"]
    assert _events(merged_whole)[0]["id"] == "cmpl-a"   # the stream's id: its first chunk's


async def test_a_later_samples_error_answer_ends_the_stream_and_the_others():
    refused = web.json_response({"error": {"message": "no", "type": "invalid_request_error", "code": 400}},
                                status=400)
    status, raw, scripted = await _merged([[_chunk("a"), None], refused, [_chunk("c"), None]])
    events = _events(raw)
    assert status == 200 and events[-2] == {"error": {"message": "no", "type": "invalid_request_error", "code": 400}}
    assert events[-1] == "[DONE]" and sorted(scripted.cancelled) == [0, 2]


async def test_a_samples_error_event_ends_the_stream_and_the_others():
    error = b'data: {"error": {"message": "boom", "type": "bad_gateway", "code": 502}}\n\ndata: [DONE]\n\n'
    status, raw, scripted = await _merged([[_chunk("a"), None], [error]])
    events = _events(raw)
    assert events[-2]["error"]["message"] == "boom" and events[-1] == "[DONE]" and 0 in scripted.cancelled


async def test_an_event_that_is_not_a_chunk_is_a_gateway_error():
    status, raw, scripted = await _merged([[_chunk("a"), None], [b"data: [1, 2]\n\n"]])
    events = _events(raw)
    assert events[-2]["error"]["code"] == 502 and 0 in scripted.cancelled


async def test_a_first_sample_refused_before_its_stream_is_the_answer():
    refused = web.Response(status=503, body=b'{"error": {}}', content_type="application/json")
    status, raw, scripted = await _merged([refused, [_chunk("b")]])
    assert status == 503 and raw == b'{"error": {}}' and scripted.started == [0]


async def test_a_client_leaving_cancels_every_sample():
    scripted = Scripted([[_chunk("a"), None], [_chunk("b"), None]])
    gone = asyncio.Event()

    async def handler(request):
        try:
            return await merge_samples(request, [{"stream": True}] * 2, "r", scripted.route)
        finally:
            gone.set()

    app = web.Application(handler_args={"handler_cancellation": True})
    app.router.add_post("/", handler)
    server = TestServer(app)
    async with TestClient(server) as client:
        resp = await client.post("/", json={})
        await resp.content.readline()
        resp.close()
        await asyncio.wait_for(gone.wait(), 30)   # a guard against a hang, not a measure
    assert sorted(scripted.cancelled) == [0, 1]
