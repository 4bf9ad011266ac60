"""What vLLM's server flags turn on for every chat or completions request: `--response-role` (the role of a chat
answer whose turn the generation prompt opened; without a generation prompt the last turn's role, as vLLM),
`--enable-force-include-usage` (the usage in every chunk and at a stream's end), `--return-tokens-as-token-ids`."""

from __future__ import annotations


import pytest
from aiohttp.test_utils import TestClient, TestServer

from hybridpd.server.chat_templating import ChatTemplating

from .conftest import make_app, parse_sse, serve_configs
from .fake_engine import FakeEngine

USER = [{"role": "user", "content": "x"}]


async def answer(config: dict, path: str, body: dict):
    client = TestClient(TestServer(make_app(FakeEngine(), **config)))
    await client.start_server()
    try:
        resp = await client.post(path, json=body)
        assert resp.status == 200, await resp.text()
        return parse_sse(await resp.text()) if body.get("stream") else await resp.json()
    finally:
        await client.close()


@pytest.mark.parametrize("config, body, role", [
    ({}, {"messages": USER}, "assistant"),
    ({"templating": ChatTemplating(response_role="model")}, {"messages": USER}, "model"),
    ({"templating": ChatTemplating(response_role="model")}, {"messages": USER, "add_generation_prompt": False},
     "user"),   # no generation prompt: the answer goes on with the last turn
])
@pytest.mark.parametrize("stream", [False, True])
async def test_the_role_of_a_chat_answer(config, body, role, stream):
    got = await answer(config, "/v1/chat/completions", {**body, "max_tokens": 2, "stream": stream})
    if stream:
        assert got[0]["choices"][0]["delta"]["role"] == role
    else:
        assert got["choices"][0]["message"]["role"] == role


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "x"}),
                                        ("/v1/chat/completions", {"messages": USER})])
async def test_force_include_usage(path, body):
    body = {**body, "max_tokens": 3, "stream": True}
    plain = await answer({}, path, body)
    forced = await answer({"force_include_usage": True}, path, body)
    assert all("usage" not in event for event in plain[:-1])
    *chunks, last_usage, done = forced
    assert done == "[DONE]" and last_usage["choices"] == [] and last_usage["usage"]["completion_tokens"] == 3
    assert all("usage" in chunk for chunk in chunks) and chunks[-1]["usage"]["completion_tokens"] == 3


async def test_tokens_as_ids_by_default():
    body = {"prompt": "x", "max_tokens": 2, "logprobs": 1}
    assert (await answer({}, "/v1/completions", body))["choices"][0]["logprobs"]["tokens"] == ["a", "b"]
    named = await answer({"tokens_as_ids": True}, "/v1/completions", body)
    assert named["choices"][0]["logprobs"]["tokens"] == ["token_id:97", "token_id:98"]


def test_the_flags():
    def server(argv):
        return serve_configs(argv).server

    plain = server([])
    assert (plain.templating.response_role, plain.force_include_usage, plain.tokens_as_ids) == ("assistant", False,
                                                                                                False)
    on = server(["--response-role", "model", "--enable-force-include-usage", "--return-tokens-as-token-ids"])
    assert (on.templating.response_role, on.force_include_usage, on.tokens_as_ids) == ("model", True, True)
