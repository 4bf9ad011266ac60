"""SSE streams like vLLM's, errors after the stream started, and clients that go away mid-stream."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from .conftest import MODEL, make_app, parse_sse
from .fake_engine import FakeEngine, fake_token

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("return_token_ids", [False, True])
async def test_completion_stream(client, include_usage, return_token_ids):
    body = {"prompt": [1, 2], "max_tokens": 3, "stream": True, "return_token_ids": return_token_ids,
            "stream_options": {"include_usage": include_usage}}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    events = parse_sse(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    text_chunks = chunks[:3]
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == "abc"
    assert [c["choices"][0]["finish_reason"] for c in text_chunks] == [None, None, "length"]
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    if return_token_ids:
        assert text_chunks[0]["choices"][0]["prompt_token_ids"] == [1, 2]
        assert [t for c in text_chunks for t in c["choices"][0]["token_ids"]] == [fake_token(i) for i in range(3)]
    else:
        assert all("token_ids" not in c["choices"][0] for c in text_chunks)
    if include_usage:
        assert len(chunks) == 4 and chunks[3]["choices"] == []
        assert chunks[3]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                                      "prompt_tokens_details": {"cached_tokens": 0}}
    else:
        assert len(chunks) == 3 and all("usage" not in c for c in chunks)


async def test_completion_stream_logprobs_continue_offsets(client):
    body = {"prompt": "x", "max_tokens": 3, "stream": True, "logprobs": 1}
    chunks = parse_sse(await (await client.post("/v1/completions", json=body)).text())[:-1]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks] == [[0], [1], [2]]
    assert [c["choices"][0]["logprobs"]["tokens"] for c in chunks] == [["a"], ["b"], ["c"]]


async def test_chat_stream(client):
    body = {"messages": USER, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    events = parse_sse(await (await client.post("/v1/chat/completions", json=body)).text())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"}]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


async def test_stream_kv_transfer_params_on_last_chunk(client, engine):
    engine.kv_transfer_params = {"do_remote_prefill": True, "remote_engine_id": "e"}
    body = {"prompt": "x", "max_tokens": 2, "stream": True}
    chunks = parse_sse(await (await client.post("/v1/completions", json=body)).text())[:-1]
    assert "kv_transfer_params" not in chunks[0]
    assert chunks[-1]["kv_transfer_params"] == engine.kv_transfer_params


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x"}),
    ("/v1/chat/completions", {"messages": USER}),
])
async def test_failure_after_stream_started_sends_error_event(client, engine, path, body):
    engine.fail_at_output = 2
    resp = await client.post(path, json={**body, "max_tokens": 8, "stream": True,
                                         "stream_options": {"include_usage": True}})
    assert resp.status == 200
    events = parse_sse(await resp.text())
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert (error["type"], error["code"]) == ("kv_transfer_error", 502) and "10.0.0.7:14579" in error["message"]
    assert all("usage" not in e for e in events[:-1])
    assert (await client.get("/health")).status == 200


async def _read_first_chunk_then_disconnect(client: TestClient, path: str, body: dict) -> None:
    resp = await client.post(path, json={**body, "stream": True})
    assert resp.status == 200
    first = await resp.content.readuntil(b"\n\n")
    assert first.startswith(b"data: {")
    resp.close()  # drop the connection mid-stream


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 100}),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 100}),
])
@pytest.mark.parametrize("mode", ["endless_engine", "stalled_engine_with_handler_cancellation"])
async def test_disconnect_mid_stream_closes_engine_generator(path, body, mode):
    """An endless engine is noticed at the next write; a stalled one only by cancelling the handler."""
    engine = FakeEngine(endless=mode == "endless_engine")
    if mode != "endless_engine":
        engine.stall_after_first = asyncio.Event()  # never set: only the disconnect can end this request
    server = TestServer(make_app(engine), handler_cancellation=mode != "endless_engine")
    client = TestClient(server)
    await client.start_server()
    try:
        await _read_first_chunk_then_disconnect(client, path, body)
        await asyncio.wait_for(engine.aborted_event.wait(), timeout=10)
        assert engine.aborted == [engine.requests[0].request_id]
        engine.endless = False
        engine.stall_after_first = None
        after = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert after.status == 200 and (await after.json())["choices"][0]["text"] == "ab"
        assert (await client.get("/health")).status == 200
    finally:
        await client.close()


async def test_finished_requests_are_not_aborted(client, engine):
    for stream in (False, True):
        resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": stream})
        await resp.read()
    assert len(engine.requests) == 2 and engine.aborted == []


@pytest.mark.parametrize(
    "path, body, expected_deltas",
    [
        ("/v1/completions", {"prompt": "x"}, ["a", "", "c", "d"]),
        ("/v1/completions", {"prompt": "x", "return_token_ids": True}, ["a", "", "c", "d"]),
        ("/v1/completions", {"prompt": "x", "logprobs": 0}, ["a", "", "c", "d"]),
        ("/v1/chat/completions", {"messages": USER}, [None, "a", "", "c", "d"]),
    ],
)
async def test_every_token_makes_a_chunk_even_without_text(client, engine, path, body, expected_deltas):
    """vLLM's streaming: a token whose text the detokenizer holds back (half a UTF-8 character) still makes a
    chunk, with empty text (and its id when asked), so clients time every token."""
    engine.textless_outputs = frozenset({1})
    resp = await client.post(path, json={**body, "max_tokens": 4, "stream": True})
    chunks = parse_sse(await resp.text())[:-1]
    choices = [c["choices"][0] for c in chunks]
    texts = [c["text"] if "text" in c else c["delta"].get("content") if "role" not in c["delta"] else None
             for c in choices]
    assert texts == expected_deltas
    assert choices[-1]["finish_reason"] == "length"


async def test_drain_lets_running_stream_finish(client, engine):
    from hybridpd.server.app import ADMISSION_KEY

    admission = client.server.app[ADMISSION_KEY]
    engine.stall_after_first = asyncio.Event()
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True})
    assert (await resp.content.readuntil(b"\n\n")).startswith(b"data: {")
    admission.close()
    assert admission.in_flight == 1
    assert (await client.post("/v1/completions", json={"prompt": "x"})).status == 503
    assert not await admission.wait_idle(timeout=0)  # the stalled stream still runs
    engine.stall_after_first.set()
    rest = parse_sse("data: {}\n\n" + (await resp.text()))
    assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "length"
    assert await admission.wait_idle(timeout=10) and engine.aborted == []


# A decode-role request whose stream head the client has (hybridpd/stream_head.py): the fake's first output plays
# the first token that the prefill node's stream carried.
REMOTE_PREFILL = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
                  "remote_block_ids": [[1]], "remote_host": "127.0.0.1", "remote_port": 9000,
                  "remote_num_tokens": 2, "first_token_id": fake_token(0)}
STREAM_HEAD = {"id": "cmpl-from-the-prefill-node", "created": 1700000001}


@pytest.mark.parametrize("path, body, expected", [
    ("/v1/completions", {"prompt": [1, 2], "logprobs": 0, "return_token_ids": True},
     [{"text": "b", "offsets": [1], "token_ids": [fake_token(1)]},
      {"text": "c", "offsets": [2], "token_ids": [fake_token(2)]}]),
    ("/v1/chat/completions", {"messages": USER},
     [{"delta": {"content": "b"}}, {"delta": {"content": "c"}}]),
])
async def test_a_continued_stream_sends_no_head_of_its_own(client, path, body, expected):
    request = {**body, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True},
               "kv_transfer_params": {**REMOTE_PREFILL, "stream_head": STREAM_HEAD}}
    resp = await client.post(path, json=request)
    assert resp.status == 200
    chunks = parse_sse(await resp.text())[:-1]
    assert all((c["id"], c["created"]) == (STREAM_HEAD["id"], STREAM_HEAD["created"]) for c in chunks)
    choices = [c["choices"][0] for c in chunks[:-1]]
    if "delta" in expected[0]:
        assert [{"delta": c["delta"]} for c in choices] == expected  # no role chunk, no first token
    else:
        assert [{"text": c["text"], "offsets": c["logprobs"]["text_offset"], "token_ids": c["token_ids"]}
                for c in choices] == expected  # the offsets go on after the first token's text
        assert all("prompt_token_ids" not in c for c in choices)
    assert [c["finish_reason"] for c in choices] == [None, "length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path, body, expected_choice", [
    ("/v1/completions", {"prompt": [1, 2], "return_token_ids": True},
     {"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None, "token_ids": []}),
    ("/v1/chat/completions", {"messages": USER},
     {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}),
    # a stop string's possible start ("a" of "ab") was held back from the head; at max_tokens it is released here
    ("/v1/completions", {"prompt": [1, 2], "stop": ["ab"]},
     {"index": 0, "text": "a", "logprobs": None, "finish_reason": "length", "stop_reason": None}),
    ("/v1/chat/completions", {"messages": USER, "stop": ["ab"]},
     {"index": 0, "delta": {"content": "a"}, "logprobs": None, "finish_reason": "length"}),
])
async def test_a_continued_stream_whose_first_token_was_its_last_only_finishes(client, path, body, expected_choice):
    request = {**body, "max_tokens": 1, "stream": True,
               "kv_transfer_params": {**REMOTE_PREFILL, "stream_head": STREAM_HEAD}}
    (chunk,) = parse_sse(await (await client.post(path, json=request)).text())[:-1]
    assert chunk["choices"] == [expected_choice]


@pytest.mark.parametrize("params, stream, message", [
    ({**REMOTE_PREFILL, "stream_head": STREAM_HEAD}, False, "needs stream: true"),
    ({"stream_head": STREAM_HEAD}, True, "needs do_remote_prefill"),
    ({**REMOTE_PREFILL, "stream_head": "cmpl-1"}, True, "must be an object"),
    ({**REMOTE_PREFILL, "stream_head": {"id": "", "created": 1}}, True, "stream_head.id must be"),
    ({**REMOTE_PREFILL, "stream_head": {"id": "x" * 257, "created": 1}}, True, "stream_head.id must be"),
    ({**REMOTE_PREFILL, "stream_head": {"id": "c", "created": -1}}, True, "stream_head.created must be"),
    ({**REMOTE_PREFILL, "stream_head": {"id": "c", "created": True}}, True, "stream_head.created must be"),
    ({**REMOTE_PREFILL, "stream_head": {"id": "c", "created": 1.5}}, True, "stream_head.created must be"),
])
async def test_a_bad_stream_head_is_a_400(client, engine, params, stream, message):
    resp = await client.post("/v1/completions", json={"prompt": "x", "stream": stream, "kv_transfer_params": params})
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"]
    assert engine.requests == []
