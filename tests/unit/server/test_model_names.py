"""The model's names in the API (vLLM's `--served-model-name`): which names a request may give, the one answers carry,
the cards /v1/models lists and the 404 for any other name."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from hybridpd.server.args import BadArgumentsError, model_names

from .conftest import make_app, serve_configs
from .fake_engine import FakeEngine
from .test_bad_input import error_of

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.mark.parametrize("served, model_dir, given, names", [
    (None, Path("/ckpt/granite"), Path("/ckpt/granite"), ("granite", "/ckpt/granite")),   # vLLM's name beside ours
    (None, Path("/ckpt/granite"), Path("granite"), ("granite",)),     # given as its own name: once
    (None, Path("/models/default-preset"), None, ("default-preset",)),   # the built-in preset: no path given
    (["a"], Path("/ckpt/granite"), Path("/ckpt/granite"), ("a",)),    # the flag replaces both
    (["a", "b", "a"], Path("/ckpt/granite"), None, ("a", "b")),       # several, each once, in order
])
def test_names_from_the_flags(served, model_dir, given, names):
    assert model_names(served, model_dir, given) == names


def test_the_flag_takes_several_names_and_refuses_an_empty_one(tmp_path):
    server = serve_configs([str(tmp_path), "--served-model-name", "first", "second"]).server
    assert (server.served_model_name, server.model_aliases, server.model_names) == (
        "first", ("second",), ("first", "second"))
    with pytest.raises(BadArgumentsError, match="--served-model-name must not be empty"):
        serve_configs([str(tmp_path), "--served-model-name", "first", ""])


@pytest.fixture
async def client() -> AsyncIterator[TestClient]:
    client = TestClient(TestServer(make_app(FakeEngine(), model_aliases=("/ckpt/fake-model",))))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


@pytest.mark.parametrize("path, body", [
    (COMPLETIONS, {"prompt": "x", "max_tokens": 1}),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
])
@pytest.mark.parametrize("model", ["fake-model", "/ckpt/fake-model", None])
async def test_any_name_is_served_and_answers_carry_the_first(client, path, body, model):
    resp = await client.post(path, json=body if model is None else {**body, "model": model})
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["model"] == "fake-model"


async def test_tokenize_takes_an_alias(client):
    resp = await client.post("/tokenize", json={"prompt": "x", "model": "/ckpt/fake-model"})
    assert resp.status == 200 and (await resp.json())["count"] >= 1


async def test_models_lists_a_card_per_name(client):
    out = await (await client.get("/v1/models")).json()
    assert [card["id"] for card in out["data"]] == ["fake-model", "/ckpt/fake-model"]
    assert {card["root"] for card in out["data"]} == {"fake-model"}


@pytest.mark.parametrize("model, message", [
    ("gpt-4", "The model `gpt-4` does not exist. Valid aliases: fake-model, <path>."),
    ("/ckpt/other", "The model `<path>` does not exist. Valid aliases: fake-model, <path>."),   # no path shown
])
async def test_another_name_is_404_naming_the_valid_ones_but_no_path(client, model, message):
    resp = await client.post(COMPLETIONS, json={"prompt": "x", "model": model})
    assert resp.status == 404
    error = error_of(await resp.json(), 404)
    assert (error["type"], error["message"]) == ("model_not_found", message)
