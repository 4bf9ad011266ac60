"""Every route, answered from the fake engine, in vLLM's shapes."""

from __future__ import annotations

import pytest

from .conftest import MODEL
from .fake_engine import fake_token

ABCD = "abcd"


@pytest.mark.parametrize(
    "body, expected_prompt_ids",
    [
        ({"prompt": "hi", "max_tokens": 4}, [104, 105]),
        ({"prompt": [1, 2, 3], "max_tokens": 4}, [1, 2, 3]),
        ({"prompt": ["hi"], "max_tokens": 4, "model": MODEL}, [104, 105]),
        ({"prompt": [[7, 8]], "max_tokens": 4, "temperature": 0, "top_k": 1000, "seed": 3}, [7, 8]),
    ],
)
async def test_completion(client, engine, body, expected_prompt_ids):
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    out = await resp.json()
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion" and out["model"] == MODEL
    assert isinstance(out["created"], int)
    assert out["choices"] == [
        {"index": 0, "text": ABCD, "logprobs": None, "finish_reason": "length", "stop_reason": None}
    ]
    n = len(expected_prompt_ids)
    assert out["usage"] == {
        "prompt_tokens": n, "completion_tokens": 4, "total_tokens": n + 4, "prompt_tokens_details": {"cached_tokens": 0}
    }
    assert out["kv_transfer_params"] is None and "prompt_token_ids" not in out
    assert list(engine.requests[-1].prompt_token_ids) == expected_prompt_ids
    assert engine.requests[-1].sampling.top_k <= engine.vocab_size


async def test_defaults_and_sampling_fields_reach_the_engine(client, engine):
    resp = await client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 16
    body = {"prompt": "x", "max_tokens": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 11,
            "stop": ["\n", "END"], "ignore_eos": True, "cache_salt": "s"}
    assert (await client.post("/v1/completions", json=body)).status == 200
    sampling = engine.requests[-1].sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed) == (2, 0.5, 0.9, 5, 11)
    assert sampling.stop == ("\n", "END") and sampling.ignore_eos and engine.requests[-1].cache_salt == b"s"


async def test_tiny_temperature_is_greedy(client, engine):
    assert (await client.post("/v1/completions", json={"prompt": "x", "temperature": 1e-9})).status == 200
    assert engine.requests[-1].sampling.temperature == 0.0


async def test_return_token_ids_and_cached_tokens(client, engine):
    engine.num_cached_tokens = 16
    resp = await client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3, "return_token_ids": True})
    out = await resp.json()
    assert out["prompt_token_ids"] == [5, 6]
    assert out["choices"][0]["token_ids"] == [fake_token(i) for i in range(3)]
    assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}


async def test_completion_logprobs(client):
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "logprobs": 2})
    logprobs = (await resp.json())["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["a", "b", "c"]
    assert logprobs["token_logprobs"] == [-0.5, -0.5, -0.5]
    assert logprobs["text_offset"] == [0, 1, 2]
    assert logprobs["top_logprobs"] == [{"a": -0.5, "b": -1.5}, {"b": -0.5, "c": -1.5}, {"c": -0.5, "d": -1.5}]


async def test_kv_transfer_params_pass_through(client, engine):
    answer = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [[1, 2]]}
    engine.kv_transfer_params = answer
    body = {"prompt": "hello", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    out = await (await client.post("/v1/completions", json=body)).json()
    assert out["kv_transfer_params"] == answer
    assert type(engine.requests[-1].kv_transfer).__name__ == "RemoteDecodeParams"


@pytest.mark.parametrize(
    "body, expected_template",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "<user>hi\n<assistant>"),
        ({"messages": [{"role": "system", "content": "be"}, {"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}, "<system>be\n<user>a\nb\n<assistant>"),
    ],
)
async def test_chat(client, engine, body, expected_template):
    resp = await client.post("/v1/chat/completions", json={**body, "max_completion_tokens": 2, "return_token_ids": True})
    assert resp.status == 200
    out = await resp.json()
    assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    assert out["choices"][0]["finish_reason"] == "length" and out["choices"][0]["token_ids"] == [97, 98]
    assert out["prompt_token_ids"] == list(expected_template.encode())
    assert out["usage"]["prompt_tokens"] == len(expected_template.encode())


async def test_chat_logprobs(client):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "logprobs": True, "top_logprobs": 1}
    out = await (await client.post("/v1/chat/completions", json=body)).json()
    assert out["choices"][0]["logprobs"] == {"content": [
        {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}]}
    ]}


async def test_models(client, engine):
    out = await (await client.get("/v1/models")).json()
    assert out["object"] == "list" and len(out["data"]) == 1
    model = out["data"][0]
    assert (model["id"], model["object"], model["max_model_len"]) == (MODEL, "model", engine.max_model_len)


@pytest.mark.parametrize("is_healthy, status", [(True, 200), (False, 503)])
async def test_health(client, engine, is_healthy, status):
    engine.is_healthy = is_healthy
    resp = await client.get("/health")
    assert resp.status == status
    assert (await resp.json())["status"] == ("ok" if is_healthy else "unhealthy")


async def test_metrics(client):
    assert (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})).status == 200
    assert (await client.post("/v1/completions", json={"prompt": ""})).status == 400
    resp = await client.get("/metrics")
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
    text = await resp.text()
    assert 'hybridpd:http_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
    assert 'hybridpd:http_requests_total{endpoint="/v1/completions",status="400"} 1.0' in text
    labels = f'engine="0",model_name="{MODEL}"'
    assert f"vllm:generation_tokens_total{{{labels}}} 3.0" in text
    assert f"vllm:prompt_tokens_total{{{labels}}} 1.0" in text
    assert f"vllm:time_to_first_token_seconds_count{{{labels}}} 1.0" in text
    assert f"vllm:inter_token_latency_seconds_count{{{labels}}} 2.0" in text
    assert f"vllm:e2e_request_latency_seconds_count{{{labels}}} 1.0" in text
    assert f'vllm:request_success_total{{engine="0",finished_reason="length",model_name="{MODEL}"}} 1.0' in text


async def test_a_caller_that_left_before_its_100_continue_ends_quietly():
    """A stopped front resumes to find callers that gave up waiting for their first byte: no answer, no traceback."""
    from types import SimpleNamespace

    from aiohttp import web

    from hybridpd.server.app import expect_continue

    class Writer:
        output_size = 5

        async def write(self, data: bytes) -> None:
            raise ConnectionResetError("Cannot write to closing transport")

    closing = SimpleNamespace(is_closing=lambda: True)
    open_ = SimpleNamespace(is_closing=lambda: False)
    headers = {"Expect": "100-continue"}
    for request in (SimpleNamespace(headers=headers, transport=closing, writer=Writer()),
                    SimpleNamespace(headers=headers, transport=open_, writer=Writer()),
                    SimpleNamespace(headers=headers, transport=None, writer=Writer())):
        with pytest.raises(web.HTTPRequestTimeout):
            await expect_continue(request)
    with pytest.raises(web.HTTPExpectationFailed):
        await expect_continue(SimpleNamespace(headers={"Expect": "something"}, transport=open_, writer=Writer()))


async def test_a_call_with_expect_100_continue_is_answered(client):
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, expect100=True)
    assert resp.status == 200
