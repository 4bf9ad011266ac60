"""A streaming client's first token comes from the prefill node's stream, before the decode call is opened; the
decode node continues that stream (proxy/prefill_stream.py, hybridpd/stream_head.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from hybridpd.proxy.prefill_stream import PrefillStreamError, read_prefill_stream

from .fake_node import (
    PREFILL_STREAM_CREATED, PREFILL_STREAM_ID, REJECT_BODY, SSE_CHUNKS, Behavior, prefill_stream_chunks,
    remote_params,
)

DEADLINE = 10.0  # seconds a test waits for an event before it fails (never a timing assertion)
COMPLETION = {"prompt": "hi", "max_tokens": 3, "stream": True}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3, "stream": True}


def events(raw: bytes) -> list[bytes]:
    return [event.removeprefix(b"data: ") for event in raw.split(b"\n\n") if event]


@pytest.mark.parametrize("path, expected_head", [
    ("/v1/completions", [
        {"id": "cmpl-p", "created": PREFILL_STREAM_CREATED, "model": "tiny", "object": "text_completion",
         "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None, "stop_reason": None}]},
    ]),
    ("/v1/chat/completions", [
        {"id": "cmpl-p", "created": PREFILL_STREAM_CREATED, "model": "tiny", "object": "chat.completion.chunk",
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}]},
        {"id": "cmpl-p", "created": PREFILL_STREAM_CREATED, "model": "tiny", "object": "chat.completion.chunk",
         "choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}]},
    ]),
])
def test_the_head_is_the_prefill_stream_without_the_calls_own_parts(path, expected_head):
    stream = read_prefill_stream(b"".join(prefill_stream_chunks(path, remote_params(9000))))
    assert [json.loads(event) for event in events(stream.head)] == expected_head
    assert stream.kv_transfer_params == remote_params(9000)
    assert (stream.stream_head.id, stream.stream_head.created) == (PREFILL_STREAM_ID, PREFILL_STREAM_CREATED)


def test_the_prefill_calls_own_usage_chunk_is_left_out_of_the_head():
    """With continuous usage stats the call ends with its own usage chunk (no choices): not the client's."""
    chunks = prefill_stream_chunks("/v1/completions", remote_params(9000))
    usage = b'data: {"id": "cmpl-p", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1}}\n\n'
    stream = read_prefill_stream(b"".join((*chunks[:-1], usage, chunks[-1])))
    assert [json.loads(event)["choices"][0]["text"] for event in events(stream.head)] == ["x"]


def test_a_prefill_stream_without_params_gives_no_head():
    stream = read_prefill_stream(b"".join(prefill_stream_chunks("/v1/completions", None)))
    assert (stream.kv_transfer_params, stream.head, stream.stream_head) == (None, b"", None)


@pytest.mark.parametrize("raw, message, from_node", [
    (b"".join(prefill_stream_chunks("/v1/completions", remote_params(9000), error=True)), "engine exploded", True),
    (b"data: {not json\n\ndata: [DONE]\n\n", "not JSON", False),
    (b"data: [1]\n\ndata: [DONE]\n\n", "not a JSON object", False),
    (prefill_stream_chunks("/v1/completions", remote_params(9000))[0], r"without \[DONE\]", False),
    (b'data: {"choices": [], "kv_transfer_params": 3}\n\ndata: [DONE]\n\n', "not an object", False),
    (b'data: {"choices": [], "kv_transfer_params": {}}\n\ndata: [DONE]\n\n', "no id or created", False),
])
def test_an_unusable_prefill_stream_is_an_error(raw, message, from_node):
    with pytest.raises(PrefillStreamError, match=message) as caught:
        read_prefill_stream(raw)
    assert caught.value.from_node is from_node


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
async def test_the_client_has_the_first_token_before_the_decode_call_answers(make_harness, path, body):
    h = await make_harness([Behavior.OK], [Behavior.HANG])
    async with h.session.post(h.url + path, json=body) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        first = b""
        while b'"x"' not in first:  # the decode node never answers: this arrives from the prefill call alone
            first += await asyncio.wait_for(resp.content.readuntil(b"\n\n"), DEADLINE)
        await asyncio.wait_for(h.decode[0].arrived.wait(), DEADLINE)
    await asyncio.wait_for(h.decode[0].cancelled.wait(), DEADLINE)  # the client left: the decode call closed
    assert h.prefill[0].received[0].body["stream"] is True
    decode_params = h.decode[0].received[0].body["kv_transfer_params"]
    assert decode_params == {**remote_params(h.prefill_ports[0]),
                             "stream_head": {"id": PREFILL_STREAM_ID, "created": PREFILL_STREAM_CREATED}}


async def test_the_decode_nodes_events_follow_the_head(make_harness):
    h = await make_harness([Behavior.OK], [Behavior.OK])
    async with h.session.post(h.url + "/v1/completions", json=COMPLETION) as resp:
        raw = await resp.read()
    assert [json.loads(e)["choices"][0]["text"] for e in events(raw)[:-1]] == ["x", "Hel", "lo", "!"]
    assert raw.endswith(b"".join(SSE_CHUNKS))


async def test_a_non_streaming_client_gets_no_head(make_harness):
    h = await make_harness([Behavior.OK], [Behavior.OK])
    async with h.session.post(h.url + "/v1/completions", json={**COMPLETION, "stream": False}) as resp:
        assert (await resp.json())["node"] == h.decode_ports[0]
    assert h.prefill[0].received[0].body["stream"] is False
    assert "stream_head" not in h.decode[0].received[0].body["kv_transfer_params"]


async def test_an_error_event_in_the_prefill_stream_is_retried_on_another_node(make_harness):
    h = await make_harness([Behavior.STREAM_ERROR, Behavior.OK], [Behavior.OK])
    for _ in range(2):  # whichever prefill node round robin starts on
        async with h.session.post(h.url + "/v1/completions", json=COMPLETION) as resp:
            assert resp.status == 200
            assert [json.loads(e)["choices"][0]["text"] for e in events(await resp.read())[:-1]] == [
                "x", "Hel", "lo", "!"]
    assert len(h.prefill[1].received) == 2 and h.prefill[0].received  # both asked; every answer from the second


async def test_a_failed_prefill_stream_falls_back_to_the_decode_node(make_harness):
    h = await make_harness([Behavior.STREAM_ERROR], [Behavior.OK])
    async with h.session.post(h.url + "/v1/completions", json=COMPLETION) as resp:
        raw = await resp.read()
    assert raw == b"".join(SSE_CHUNKS)  # no head: the decode node computed the prompt and streams it all
    assert "kv_transfer_params" not in h.decode[0].received[0].body


async def test_a_prefill_stream_without_params_lets_the_decoder_stream_everything(make_harness):
    h = await make_harness([Behavior.NO_PARAMS], [Behavior.OK])
    async with h.session.post(h.url + "/v1/completions", json=COMPLETION) as resp:
        assert await resp.read() == b"".join(SSE_CHUNKS)
    assert "kv_transfer_params" not in h.decode[0].received[0].body


async def test_a_decode_refusal_after_the_head_is_an_error_event(make_harness):
    h = await make_harness([Behavior.OK], [Behavior.REJECT])
    async with h.session.post(h.url + "/v1/completions", json=COMPLETION) as resp:
        assert resp.status == 200
        raw = await resp.read()
    head, error, done = events(raw)
    assert json.loads(head)["choices"][0]["text"] == "x"
    assert json.loads(error) == json.loads(REJECT_BODY)
    assert done == b"[DONE]"


async def test_an_unreachable_decode_node_after_the_head_is_an_error_event(make_harness):
    h = await make_harness([Behavior.OK], [None])
    async with h.session.post(h.url + "/v1/completions", json=COMPLETION) as resp:
        assert resp.status == 200
        head, error, done = events(await resp.read())
    assert json.loads(error)["error"]["code"] == 502 and done == b"[DONE]"


async def test_turned_off_the_decode_node_streams_the_first_token(make_harness):
    h = await make_harness([Behavior.OK], [Behavior.OK], first_token_from_prefill=False)
    async with h.session.post(h.url + "/v1/completions", json=COMPLETION) as resp:
        assert await resp.read() == b"".join(SSE_CHUNKS)
    assert h.prefill[0].received[0].body["stream"] is False
    assert h.decode[0].received[0].body["kv_transfer_params"] == remote_params(h.prefill_ports[0])
