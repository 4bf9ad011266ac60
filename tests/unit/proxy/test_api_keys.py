"""vLLM's `--api-key` on the node and the proxy: which requests are refused (a table), where the keys come from, and
a node and a proxy that ask for them (401 in each route's error shape; the proxy presents its key to the nodes)."""

from __future__ import annotations

import argparse

import pytest
from aiohttp.test_utils import TestClient, TestServer

from hybridpd.api_keys import ApiKeys, add_api_key_argument
from tests.unit.proxy.fake_node import Behavior
from tests.unit.server.conftest import MODEL, make_app
from tests.unit.server.fake_engine import FakeEngine

KEYS = ApiKeys(("k-one", "k-two"))


@pytest.mark.parametrize("method, path, headers, refused", [
    ("POST", "/v1/completions", {}, True),
    ("POST", "/v1/completions", {"Authorization": "Bearer k-one"}, False),
    ("POST", "/v1/completions", {"Authorization": "bearer k-two"}, False),
    ("POST", "/v1/messages", {"x-api-key": "k-two"}, False),
    ("POST", "/v1/messages", {"x-api-key": "k-three"}, True),
    ("POST", "/v1/completions", {"Authorization": "Basic k-one"}, True),
    ("POST", "/v1/completions", {"Authorization": "Bearer k-one "}, True),
    ("POST", "/v1/completions", {"Authorization": "Bearer k-on"}, True),
    ("POST", "/v1/completions", {"Authorization": "Bearer wrong", "x-api-key": "k-one"}, False),
    ("GET", "/v1/models", {}, True),
    ("GET", "/v1", {}, True),
    ("OPTIONS", "/v1/completions", {}, False),   # a CORS preflight
    ("GET", "/health", {}, False),
    ("GET", "/metrics", {}, False),
    ("POST", "/tokenize", {}, False),
    ("POST", "/v10/x", {}, False),
])
def test_which_requests_are_refused(method, path, headers, refused):
    assert KEYS.refuses(method, path, headers) is refused
    assert ApiKeys().refuses(method, path, headers) is False


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_api_key_argument(parser, "the key")
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv, environ, keys", [
    ([], {}, ()),
    ([], {"VLLM_API_KEY": "from-env"}, ("from-env",)),
    ([], {"VLLM_API_KEY": ""}, ()),
    (["--api-key", "a", "--api-key", "b"], {"VLLM_API_KEY": "from-env"}, ("a", "b")),   # the flag wins, as vLLM's
])
def test_keys_come_from_the_flag_or_vllms_variable(argv, environ, keys):
    api_keys = ApiKeys.from_args(_args(argv), environ)
    assert api_keys.keys == keys and "from-env" not in repr(api_keys) and "'a'" not in repr(api_keys)


def test_an_empty_key_is_refused():
    with pytest.raises(ValueError, match="--api-key"):
        ApiKeys.from_args(_args(["--api-key", ""]), {})


@pytest.mark.parametrize("path, body, shape", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "openai"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}, "anthropic"),
])
async def test_a_node_with_keys_asks_for_one(path, body, shape):
    client = TestClient(TestServer(make_app(FakeEngine(), api_keys=KEYS)))
    await client.start_server()
    try:
        resp = await client.post(path, json=body)
        assert resp.status == 401
        error = await resp.json()
        if shape == "openai":
            assert error["error"]["type"] == "authentication_error" and error["error"]["code"] == 401
        else:
            assert error["type"] == "error" and error["error"]["type"] == "authentication_error"
        header = {"Authorization": "Bearer k-two"} if shape == "openai" else {"x-api-key": "k-one"}
        assert (await client.post(path, json=body, headers=header)).status == 200
        assert (await client.get("/health")).status == 200
        assert (await client.post("/tokenize", json={"prompt": "hi"})).status == 200
    finally:
        await client.close()


async def test_a_proxy_with_keys_asks_clients_for_one_and_shows_its_first_to_the_nodes(make_harness):
    h = await make_harness([Behavior.OK], [Behavior.OK], api_keys=KEYS)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
    async with h.session.post(h.url + "/v1/completions", json=body) as resp:
        assert resp.status == 401
        assert (await resp.json())["error"]["type"] == "authentication_error"
    assert h.prefill[0].received == [] and h.decode[0].received == []
    async with h.session.post(h.url + "/v1/messages", json=body) as resp:
        assert resp.status == 401 and (await resp.json())["type"] == "error"
    async with h.session.post(h.url + "/v1/completions", json=body, headers={"x-api-key": "k-two"}) as resp:
        assert resp.status == 200
    (prefill,) = h.prefill[0].received
    (decode,) = h.decode[0].received
    assert prefill.headers["Authorization"] == decode.headers["Authorization"] == "Bearer k-one"
    async with h.session.get(h.url + "/health") as resp:
        assert resp.status == 200
