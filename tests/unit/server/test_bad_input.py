"""Every bad input answers a 4xx in OpenAI's error shape, and the node stays healthy."""

from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from hybridpd.engine.model.generation_config import GenerationDefaults
from hybridpd.errors import InvalidRequestError, KVTransferError, ServerOverloadedError

from .conftest import make_app
from .fake_engine import FakeEngine

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def error_of(out: dict, status: int) -> dict:
    assert set(out) == {"error"}, out
    error = out["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.mark.parametrize(
    "path, body, param",
    [
        (COMPLETIONS, {}, "prompt"),
        (COMPLETIONS, {"prompt": ""}, "prompt"),
        (COMPLETIONS, {"prompt": []}, "prompt"),
        (COMPLETIONS, {"prompt": ["a", 1]}, "prompt"),
        (COMPLETIONS, {"prompt": ["a", "b"], "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
        (COMPLETIONS, {"prompt": [[1], [2]], "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
        (COMPLETIONS, {"prompt": ["a", ""]}, "prompt"),
        (COMPLETIONS, {"prompt": 5}, "prompt"),
        (COMPLETIONS, {"prompt": [1, True]}, "prompt"),
        (COMPLETIONS, {"prompt": [1, 2.0]}, "prompt"),
        (COMPLETIONS, {"prompt": [1, 260]}, "prompt"),
        (COMPLETIONS, {"prompt": [-1]}, "prompt"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": "3"}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": True}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 2.0}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 129}, "max_tokens"),           # beyond max_model_len
        (COMPLETIONS, {"prompt": "x" * 129, "max_tokens": 1}, "input_tokens"),     # a prompt beyond it
        (COMPLETIONS, {"prompt": "x" * 128, "max_tokens": 1}, "max_tokens"),       # one that fills it
        (COMPLETIONS, {"prompt": "x", "max_tokens": 10**30}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "temperature": -0.1}, "temperature"),
        (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, "temperature"),
        (COMPLETIONS, {"prompt": "x", "temperature": 1e400}, None),  # sent as Infinity: not JSON
        (COMPLETIONS, {"prompt": "x", "top_p": 0}, "top_p"),
        (COMPLETIONS, {"prompt": "x", "top_p": 1.5}, "top_p"),
        (COMPLETIONS, {"prompt": "x", "top_k": -2}, "top_k"),
        (COMPLETIONS, {"prompt": "x", "top_k": 1.5}, "top_k"),
        (COMPLETIONS, {"prompt": "x", "seed": 2**64}, "seed"),
        (COMPLETIONS, {"prompt": "x", "stop": 3}, "stop"),
        (COMPLETIONS, {"prompt": "x", "stop": [""]}, "stop"),
        (COMPLETIONS, {"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
        (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs"),
        (COMPLETIONS, {"prompt": "x", "logprobs": True}, "logprobs"),
        (COMPLETIONS, {"prompt": "x", "n": 0}, "n"),
        (COMPLETIONS, {"prompt": "x", "n": 129}, "n"),
        (COMPLETIONS, {"prompt": "x", "n": "2"}, "n"),
        (COMPLETIONS, {"prompt": "x", "n": 2.0}, "n"),
        (CHAT, {"messages": USER, "n": -1}, "n"),
        (COMPLETIONS, {"prompt": "x", "n": 2, "kv_transfer_params": {"do_remote_decode": True}}, "n"),
        (CHAT, {"messages": USER, "n": 3, "kv_transfer_params": {"do_remote_decode": True}}, "n"),
        (CHAT, {"messages": USER, "n": 2, "best_of": 3}, "best_of"),
        (COMPLETIONS, {"prompt": "x", "n": 2, "temperature": 0}, "n"),     # vLLM: n must be 1 when greedy
        (CHAT, {"messages": USER, "n": 3, "temperature": 0.0}, "n"),
        (COMPLETIONS, {"prompt": "x", "echo": 1}, "echo"),
        (COMPLETIONS, {"prompt": "x", "stream": "yes"}, "stream"),
        (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        (COMPLETIONS, {"prompt": "x", "stream": True, "stream_options": []}, "stream_options"),
        (COMPLETIONS, {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
         "stream_options.include_usage"),
        (COMPLETIONS, {"prompt": "x", "return_token_ids": "true"}, "return_token_ids"),
        (COMPLETIONS, {"prompt": "x", "kv_transfer_params": []}, "kv_transfer_params"),
        (COMPLETIONS, {"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}},
         "kv_transfer_params.remote_port"),
        (COMPLETIONS, {"prompt": "x", "model": 3}, "model"),
        (CHAT, {}, "messages"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {"messages": "hi"}, "messages"),
        (CHAT, {"messages": [3]}, "messages[0]"),
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        (CHAT, {"messages": [{"content": "x"}]}, "messages[0].role"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        (CHAT, {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
        (CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"messages": USER, "logprobs": 2}, "logprobs"),
        (CHAT, {"messages": USER, "max_tokens": 500}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "min_p": 1.5}, "min_p"),
        (COMPLETIONS, {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        (COMPLETIONS, {"prompt": "x", "frequency_penalty": "a lot"}, "frequency_penalty"),
        (COMPLETIONS, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        (COMPLETIONS, {"prompt": "x", "min_tokens": 17}, "min_tokens"),
        (COMPLETIONS, {"prompt": "x", "min_tokens": -1}, "min_tokens"),
        (COMPLETIONS, {"prompt": "x", "stop_token_ids": [1, 260]}, "stop_token_ids"),
        (COMPLETIONS, {"prompt": "x", "stop_token_ids": 5}, "stop_token_ids"),
        (COMPLETIONS, {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        (COMPLETIONS, {"prompt": "x", "logit_bias": {"300": 1}}, "logit_bias"),
        (COMPLETIONS, {"prompt": "x", "logit_bias": {"3": "up"}}, "logit_bias.3"),
        (COMPLETIONS, {"prompt": "x", "logit_bias": [3]}, "logit_bias"),
        (COMPLETIONS, {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
        (COMPLETIONS, {"prompt": "x", "allowed_token_ids": [-1]}, "allowed_token_ids"),
        # fields vLLM acts on that this server does not: refused rather than ignored
        (COMPLETIONS, {"prompt": "x", "best_of": 2}, "best_of"),
        (COMPLETIONS, {"prompt": "x", "use_beam_search": True}, "use_beam_search"),
        (COMPLETIONS, {"prompt": "x", "suffix": "end"}, "suffix"),
        (COMPLETIONS, {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        (CHAT, {"messages": USER, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        (COMPLETIONS, {"prompt": "x", "bad_words": "no"}, "bad_words"),
        (COMPLETIONS, {"prompt": "x", "bad_words": ["no", " "]}, "bad_words"),
        (COMPLETIONS, {"prompt": "x", "bad_words": [1]}, "bad_words"),
        (COMPLETIONS, {"prompt": "x", "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
        (COMPLETIONS, {"prompt": "x", "skip_special_tokens": "no"}, "skip_special_tokens"),
        (CHAT, {"messages": USER, "continue_final_message": True}, "continue_final_message"),
        (CHAT, {"messages": USER, "add_special_tokens": None, "add_generation_prompt": 0}, "add_generation_prompt"),
        (COMPLETIONS, {"prompt": "x", "response_format": {"type": "xml"}}, "response_format.type"),
        (COMPLETIONS, {"prompt": "x", "guided_json": {"type": "object"}}, "guided_json"),
        (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}},
         "response_format.json_schema.schema"),
        (CHAT, {"messages": USER, "structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        (CHAT, {"messages": USER, "tools": [{"type": "function"}], "tool_choice": "none"}, "tools[0].function"),
        (CHAT, {"messages": USER, "tools": []}, "tools"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": [1]}, "prompt"),
    ],
)
async def test_bad_field_is_400(client, path, body, param):
    resp = await client.post(path, json=body)
    assert resp.status == 400, await resp.text()
    error = error_of(await resp.json(), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert (await client.get("/health")).status == 200


@pytest.mark.parametrize(
    "data, headers",
    [
        (b"{not json", {"Content-Type": "application/json"}),
        (b"", {"Content-Type": "application/json"}),
        (b"[1, 2]", {"Content-Type": "application/json"}),
        (b'"prompt"', {"Content-Type": "application/json"}),
        (b'{"prompt": "x", "temperature": NaN}', {"Content-Type": "application/json"}),
        (b'{"prompt": "x", "temperature": -Infinity}', {"Content-Type": "application/json"}),
        (b'{"prompt": "\xff"}', {"Content-Type": "application/json"}),
        (b"[" * 100000 + b"]" * 100000, {"Content-Type": "application/json"}),
        (b'{"prompt": ' + b"9" * 5000 + b"}", {"Content-Type": "application/json"}),
        (b'{"prompt": "x"}', {"Content-Type": "text/plain"}),
        (b'prompt=x', {"Content-Type": "application/x-www-form-urlencoded"}),
    ],
)
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, "/tokenize"])
async def test_malformed_body_is_400(client, path, data, headers):
    resp = await client.post(path, data=data, headers=headers)
    assert resp.status == 400, await resp.text()
    assert error_of(await resp.json(), 400)["type"] == "invalid_request_error"
    assert (await client.get("/health")).status == 200


@pytest.mark.parametrize("path, body, max_tokens", [
    (COMPLETIONS, {"prompt": "x" * 120, "max_tokens": 9}, 8),            # cut to what the context leaves
    (COMPLETIONS, {"prompt": "x" * 120}, 8),                              # the default 16, cut
    (COMPLETIONS, {"prompt": "x"}, 16),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 128}, 127),
    (CHAT, {"messages": USER}, 128 - len(b"<user>hi\n<assistant>")),      # chat's default: the rest of the context
    (CHAT, {"messages": USER, "max_completion_tokens": 128, "max_tokens": 1}, 128 - len(b"<user>hi\n<assistant>")),
    (CHAT, {"messages": USER, "max_tokens": 3}, 3),
])
async def test_the_output_length_follows_vllms_rules(client, engine, path, body, max_tokens):
    """vLLM's: a max_tokens the context cannot hold after the prompt is cut to what it leaves, not refused."""
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    assert engine.requests[-1].sampling.max_tokens == max_tokens


async def test_body_without_content_type_is_accepted(client):
    resp = await client.post(COMPLETIONS, data=json.dumps({"prompt": "x", "max_tokens": 1}).encode(),
                             skip_auto_headers=["Content-Type"])
    assert resp.status == 200, await resp.text()


@pytest.mark.parametrize(
    "method, path, status, kind",
    [
        ("GET", "/nope", 404, "not_found_error"),
        ("POST", "/v1/embeddings", 404, "not_found_error"),
        ("GET", "/v1/completions", 405, "method_not_allowed"),
        ("POST", "/health", 405, "method_not_allowed"),
    ],
)
async def test_unknown_route_and_method(client, method, path, status, kind):
    resp = await client.request(method, path)
    assert resp.status == status
    assert error_of(await resp.json(), status)["type"] == kind


@pytest.mark.parametrize("path, extra", [(COMPLETIONS, {"prompt": "x"}), (CHAT, {"messages": USER}),
                                         ("/tokenize", {"prompt": "x"})])
async def test_unknown_model_is_404(client, path, extra):
    resp = await client.post(path, json={**extra, "model": "gpt-4"})
    assert resp.status == 404
    error = error_of(await resp.json(), 404)
    assert (error["type"], error["param"]) == ("model_not_found", "model") and "gpt-4" in error["message"]


@pytest.mark.parametrize(
    "raised, status, kind, words",
    [
        (InvalidRequestError("token id 999 is outside the vocabulary", "prompt"), 400, "invalid_request_error", "999"),
        (ServerOverloadedError("queue is full"), 503, "server_overloaded", "queue is full"),
        (KVTransferError("10.1.1.1:14579", "connection refused"), 502, "kv_transfer_error", "10.1.1.1:14579"),
        (RuntimeError("secret detail"), 500, "internal_error", "internal error"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_engine_errors_before_first_output_map_to_status(client, engine, raised, status, kind, words, stream):
    engine.raise_before_first = raised
    resp = await client.post(COMPLETIONS, json={"prompt": "x", "stream": stream})
    assert resp.status == status
    error = error_of(await resp.json(), status)
    assert error["type"] == kind and words in error["message"] and "secret" not in error["message"]
    engine.raise_before_first = None
    assert (await client.get("/health")).status == 200


async def test_request_failing_at_first_output_is_502(client, engine):
    engine.fail_at_output = 0
    resp = await client.post(COMPLETIONS, json={"prompt": "x"})
    assert resp.status == 502
    assert "10.0.0.7:14579" in error_of(await resp.json(), 502)["message"]


async def test_request_failing_later_non_streaming_is_502(client, engine):
    engine.fail_at_output = 3
    resp = await client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 8})
    assert resp.status == 502
    assert error_of(await resp.json(), 502)["type"] == "kv_transfer_error"


@pytest.mark.parametrize(
    "headers, status",
    [({}, 401), ({"X-HybridPD-Cluster-Token": "wrong"}, 401), ({"X-HybridPD-Cluster-Token": "s3cret"}, 200)],
)
async def test_cluster_token_guards_kv_transfer_params(aiohttp_client_factory, headers, status):
    client = await aiohttp_client_factory(cluster_token="s3cret")
    body = {"prompt": "x", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    resp = await client.post(COMPLETIONS, json=body, headers=headers)
    assert resp.status == status
    if status == 401:
        assert "s3cret" not in (await resp.text())
    plain = await client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1})
    assert plain.status == 200


async def test_draining_server_refuses_new_requests(client):
    from hybridpd.server.app import ADMISSION_KEY

    client.server.app[ADMISSION_KEY].close()
    resp = await client.post(COMPLETIONS, json={"prompt": "x"})
    assert resp.status == 503 and error_of(await resp.json(), 503)["type"] == "server_overloaded"
    assert (await client.get("/health")).status == 503
    assert await client.server.app[ADMISSION_KEY].wait_idle(timeout=5)


@pytest.fixture
async def aiohttp_client_factory(engine):
    from aiohttp.test_utils import TestClient, TestServer

    clients = []

    async def make(**config):
        client = TestClient(TestServer(make_app(engine, **config)))
        await client.start_server()
        clients.append(client)
        return client

    try:
        yield make
    finally:
        for client in clients:
            await client.close()


async def test_body_too_large_is_413(aiohttp_client_factory):
    client = await aiohttp_client_factory(client_max_size=1024)
    resp = await client.post(COMPLETIONS, json={"prompt": "x" * 4096})
    assert resp.status == 413
    assert error_of(await resp.json(), 413)["type"] == "request_too_large"
    assert (await client.get("/health")).status == 200


@pytest.mark.parametrize("literal", [b"1e400", b"-1e400"])
async def test_overflowing_number_is_400(client, literal):
    resp = await client.post(COMPLETIONS, data=b'{"prompt": "x", "temperature": ' + literal + b"}",
                             headers={"Content-Type": "application/json"})
    assert resp.status == 400 and error_of(await resp.json(), 400)["param"] == "temperature"


async def test_a_cluster_token_header_that_is_not_utf8_is_a_401(aiohttp_client_factory):
    """Sent as raw bytes (no client library sends them): the header arrives with surrogate escapes; once a 500
    (UnicodeEncodeError)."""
    import asyncio
    import json

    client = await aiohttp_client_factory(cluster_token="s3cret")
    body = json.dumps({"prompt": "x", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).encode()
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(b"POST " + COMPLETIONS.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"X-HybridPD-Cluster-Token: \xff\xfe\x80\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\nConnection: close\r\n\r\n" + body)
    await writer.drain()
    status_line = await reader.readline()
    writer.close()
    assert status_line.split()[1] == b"401", status_line


@pytest.mark.parametrize("path, body", [
    (COMPLETIONS, {"prompt": "x", "best_of": 1, "use_beam_search": False, "suffix": "", "bad_words": [],
                   "include_stop_str_in_output": False, "response_format": {"type": "text"}, "prompt_logprobs": None}),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}),
    (CHAT, {"messages": USER, "tool_choice": "none", "parallel_tool_calls": False}),
])
async def test_the_same_fields_at_values_that_change_nothing_are_accepted(client, path, body):
    resp = await client.post(path, json=body | {"max_tokens": 2})
    assert resp.status == 200, await resp.text()


async def test_sampling_fields_reach_the_engine(client, engine):
    body = {"prompt": "x", "max_tokens": 6, "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.25,
            "repetition_penalty": 1.2, "min_tokens": 2, "stop_token_ids": [7, 9, 7], "logit_bias": {"5": 300, "6": -2},
            "allowed_token_ids": [5, 6, 7]}
    assert (await client.post(COMPLETIONS, json=body)).status == 200
    sampling = engine.requests[-1].sampling
    assert (sampling.min_p, sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty,
            sampling.min_tokens) == (0.1, 0.5, -0.25, 1.2, 2)
    assert sampling.stop_token_ids == (7, 9) and sampling.allowed_token_ids == (5, 6, 7)
    assert sampling.logit_bias == ((5, 100.0), (6, -2.0))    # clamped to [-100, 100], as vLLM does


async def test_a_prefill_request_takes_min_tokens_cut_to_its_one_token(client, engine):
    body = {"prompt": "x", "max_tokens": 1, "min_tokens": 5, "kv_transfer_params": {"do_remote_decode": True}}
    assert (await client.post(COMPLETIONS, json=body)).status == 200
    assert engine.requests[-1].sampling.min_tokens == 1
    resp = await client.post(COMPLETIONS, json=body | {"kv_transfer_params": None})
    assert error_of(await resp.json(), 400)["param"] == "min_tokens"


async def test_the_checkpoints_defaults_fill_the_fields_a_request_omits():
    engine = FakeEngine(generation_defaults=GenerationDefaults(min_p=0.05, repetition_penalty=1.1,
                                                               presence_penalty=0.5, frequency_penalty=0.25))
    client = TestClient(TestServer(make_app(engine)))
    await client.start_server()
    try:
        assert (await client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2})).status == 200
        assert (await client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2, "min_p": 0,
                                                     "repetition_penalty": 1})).status == 200
    finally:
        await client.close()
    omitted, given = (r.sampling for r in engine.requests)
    assert (omitted.min_p, omitted.repetition_penalty, omitted.presence_penalty, omitted.frequency_penalty) == (
        0.05, 1.1, 0.5, 0.25)
    assert (given.min_p, given.repetition_penalty) == (0.0, 1.0)
