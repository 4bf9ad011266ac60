"""The exact request shapes of vLLM's toy proxy, field by field, and byte-for-byte passthrough."""

from __future__ import annotations

import json

import pytest

from hybridpd.proxy.bodies import decode_body, prefill_body
from hybridpd.wire_headers import CLUSTER_TOKEN_HEADER

from .conftest import DOWN
from .fake_node import SSE_CHUNKS, USAGE_CHUNK, Behavior, remote_params

# vLLM's toy proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py) sends the prefill node
# exactly these kv_transfer_params; copied field by field. One difference: the toy proxy never streams the
# prefill call, ours streams it when the client streams (its events are the head of the client's stream).
TOY_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@pytest.mark.parametrize("client_body, expected_prefill", [
    (
        {"model": "m", "prompt": "hi", "max_tokens": 20, "temperature": 0.0},
        {"model": "m", "prompt": "hi", "max_tokens": 1, "temperature": 0.0, "stream": False,
         "kv_transfer_params": TOY_PREFILL_PARAMS},
    ),
    (
        {"model": "m", "prompt": [1, 2, 3], "max_tokens": 5, "stream": True,
         "stream_options": {"include_usage": True}, "min_tokens": 3, "seed": 4},
        {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "stream": True, "seed": 4,
         "kv_transfer_params": TOY_PREFILL_PARAMS},
    ),
    (
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9,
         "min_completion_tokens": 2},
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
         "max_completion_tokens": 1, "stream": False, "kv_transfer_params": TOY_PREFILL_PARAMS},
    ),
    (   # the usage in every chunk: the head's chunks carry it too
        {"prompt": "a", "max_tokens": 5, "stream": True,
         "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        {"prompt": "a", "max_tokens": 1, "stream": True, "kv_transfer_params": TOY_PREFILL_PARAMS,
         "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    ),
    (   # one token only: its chunk is also the last, so the decode node streams it
        {"prompt": "a", "max_tokens": 1, "stream": True},
        {"prompt": "a", "max_tokens": 1, "stream": False, "kv_transfer_params": TOY_PREFILL_PARAMS},
    ),
    (
        {"messages": [], "max_tokens": 5, "max_completion_tokens": 1, "stream": True},
        {"messages": [], "max_tokens": 1, "max_completion_tokens": 1, "stream": False,
         "kv_transfer_params": TOY_PREFILL_PARAMS},
    ),
    (   # a client's own kv_transfer_params never reach the prefill node
        {"prompt": "a", "kv_transfer_params": {"do_remote_prefill": True}},
        {"prompt": "a", "max_tokens": 1, "stream": False, "kv_transfer_params": TOY_PREFILL_PARAMS},
    ),
])
def test_prefill_body_matches_toy_proxy(client_body, expected_prefill):
    original = json.loads(json.dumps(client_body))
    assert prefill_body(client_body) == expected_prefill
    assert client_body == original  # never edited in place


@pytest.mark.parametrize("first_token_from_prefill", [True, False])
def test_a_responses_prefill_body_asks_for_one_output_token_unstreamed(first_token_from_prefill):
    """Its length is `max_output_tokens`; its stream never begins with the prefill node's (Responses events are not
    chat chunks)."""
    client_body = {"model": "m", "input": "hi", "max_output_tokens": 20, "stream": True, "min_tokens": 2}
    assert prefill_body(client_body, first_token_from_prefill, "/v1/responses") == {
        "model": "m", "input": "hi", "max_output_tokens": 1, "stream": False, "kv_transfer_params": TOY_PREFILL_PARAMS}


@pytest.mark.parametrize("first_token_from_prefill", [True, False])
def test_a_messages_prefill_body_asks_for_one_output_token_unstreamed(first_token_from_prefill):
    """An Anthropic Messages body: its length is `max_tokens`, its stream never begins with the prefill node's (its
    events are not chat chunks)."""
    client_body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True}
    assert prefill_body(client_body, first_token_from_prefill, "/v1/messages") == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": False,
        "kv_transfer_params": TOY_PREFILL_PARAMS}


@pytest.mark.parametrize("params, expected_extra", [
    (remote_params(9000), {"kv_transfer_params": remote_params(9000)}),
    (None, {}),
    ({}, {}),
])
def test_decode_body_carries_the_prefill_answer(params, expected_extra):
    body = {"prompt": "hi", "max_tokens": 7, "stream": True, "kv_transfer_params": {"stale": 1}}
    assert decode_body(body, params) == {"prompt": "hi", "max_tokens": 7, "stream": True, **expected_extra}


@pytest.mark.parametrize("path, client_body", [
    ("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hello"}],
                              "max_completion_tokens": 3}),
    ("/v1/responses", {"model": "tiny", "input": "hello", "max_output_tokens": 3}),
    ("/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}),
])
async def test_prefill_then_decode_through_the_proxy(make_harness, path, client_body):
    h = await make_harness([Behavior.OK], [Behavior.OK], cluster_token="s3cret")
    async with h.session.post(h.url + path, json=client_body, headers={"X-Request-Id": "abc-1"}) as resp:
        assert resp.status == 200
        assert resp.headers["X-Request-Id"] == "abc-1"
        assert (await resp.json())["node"] == h.decode_ports[0]
    (prefill,) = h.prefill[0].received
    (decode,) = h.decode[0].received
    assert prefill.path == decode.path == path
    assert prefill.body == prefill_body(client_body, path=path)
    assert prefill.body["kv_transfer_params"] == TOY_PREFILL_PARAMS
    assert decode.body == {**client_body, "kv_transfer_params": remote_params(h.prefill_ports[0])}
    assert prefill.headers["X-Request-Id"] == "abc-1-prefill"
    assert decode.headers["X-Request-Id"] == "abc-1"
    assert prefill.headers[CLUSTER_TOKEN_HEADER] == decode.headers[CLUSTER_TOKEN_HEADER] == "s3cret"
    assert "Authorization" not in prefill.headers and "Authorization" not in decode.headers


async def test_no_token_means_no_token_header_and_ids_are_generated(make_harness):
    h = await make_harness([Behavior.OK], [Behavior.OK])
    async with h.session.post(h.url + "/v1/completions", json={"prompt": "x"}) as resp:
        assert resp.status == 200
        request_id = resp.headers["X-Request-Id"]
    assert len(request_id) >= 16
    assert CLUSTER_TOKEN_HEADER not in h.prefill[0].received[0].headers
    assert h.decode[0].received[0].headers["X-Request-Id"] == request_id


async def test_prefill_without_params_lets_the_decoder_compute(make_harness):
    h = await make_harness([Behavior.NO_PARAMS], [Behavior.OK])
    async with h.session.post(h.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as resp:
        assert resp.status == 200
    assert h.decode[0].received[0].body == {"prompt": "x", "max_tokens": 2}


async def test_stream_is_passed_through_byte_for_byte(make_harness):
    """After the head taken from the prefill node's stream (test_stream_head.py), the decode node's bytes as
    they are."""
    h = await make_harness([Behavior.OK], [Behavior.OK])
    body = {"prompt": "hi", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    async with h.session.post(h.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = await resp.read()
    head, rest = raw.split(b"\n\n", 1)
    assert json.loads(head.removeprefix(b"data: "))["choices"][0]["text"] == "x"
    assert rest == b"".join(SSE_CHUNKS[:-1] + (USAGE_CHUNK,) + SSE_CHUNKS[-1:])
    assert h.decode[0].received[0].body["stream_options"] == {"include_usage": True}
    assert "stream_options" not in h.prefill[0].received[0].body


@pytest.mark.parametrize("client_body", [
    {"prompt": [5, 6, 7], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0},   # lm-eval's loglikelihood
    {"prompt": "hi", "max_tokens": 4, "prompt_logprobs": 0},
    {"prompt": "hi", "max_tokens": 4, "prompt_logprobs": 2, "kv_transfer_params": {"stale": 1}},
    {"prompt": ["hi", "there"], "max_tokens": 4},                                             # several prompts
    {"prompt": [[1, 2], [3]], "max_tokens": 1, "logprobs": 1, "echo": True},                  # lm-eval's batches
])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_scoring_its_prompt_is_served_whole_by_a_prefill_node(make_harness, client_body, stream):
    """Its prompt's logprobs come from computing the prompt, which a pull does not give (and one prefill answer
    carries the kv_transfer_params of one prompt): no split, no lease."""
    h = await make_harness([Behavior.OK, Behavior.OK], [Behavior.OK])
    body = client_body | {"stream": stream}
    async with h.session.post(h.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        raw = await resp.read()
    received = [r for node in h.prefill for r in node.received]
    assert [r.body for r in received] == [decode_body(body, None)]
    assert "kv_transfer_params" not in received[0].body
    assert h.decode[0].received == []
    served_by = next(node.port for node in h.prefill if node.received)
    assert raw == b"".join(SSE_CHUNKS) if stream else json.loads(raw)["node"] == served_by


@pytest.mark.parametrize("client_body", [
    {"prompt": "hi", "max_tokens": 2, "echo": True},                   # the prompt's text only: P/D as usual
    {"prompt": "hi", "max_tokens": 2, "logprobs": 1, "echo": False},
    {"prompt": ["one prompt in a list"], "max_tokens": 2},
])
async def test_echo_without_logprobs_is_split_as_usual(make_harness, client_body):
    h = await make_harness([Behavior.OK], [Behavior.OK])
    async with h.session.post(h.url + "/v1/completions", json=client_body) as resp:
        assert resp.status == 200
    assert h.prefill[0].received[0].body == prefill_body(client_body)
    assert h.decode[0].received[0].body == {**client_body, "kv_transfer_params": remote_params(h.prefill_ports[0])}


@pytest.mark.parametrize("fallback", [True, False])
async def test_with_no_prefill_node_reachable_a_scoring_request_goes_to_a_decode_node(make_harness, fallback):
    h = await make_harness([DOWN], [Behavior.OK], fallback_colocated=fallback)
    body = {"prompt": "hi", "max_tokens": 2, "prompt_logprobs": 1}
    async with h.session.post(h.url + "/v1/completions", json=body) as resp:
        assert resp.status == (200 if fallback else 502)
    assert [r.body for r in h.decode[0].received] == ([body] if fallback else [])
