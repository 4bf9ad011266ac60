"""vLLM's tokenizer endpoints: `/tokenize` (a prompt or chat messages; `add_special_tokens`, `add_generation_prompt`,
`return_token_strs`), `/detokenize`, and `/tokenizer_info` when the node is started with it (what
lm-evaluation-harness's remote tokenizer reads); and the request fields that steer tokenization and the text
(`truncate_prompt_tokens`, `chat_template_kwargs`, `include_stop_str_in_output`, `skip_special_tokens`,
`return_tokens_as_token_ids`)."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from .conftest import MODEL, make_app, parse_sse
from .fake_engine import FakeEngine

USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("body, tokens, strs", [
    ({"prompt": "hi"}, [104, 105], None),
    ({"prompt": ""}, [], None),
    ({"prompt": "hi", "return_token_strs": True, "model": MODEL}, [104, 105], ["h", "i"]),
    ({"messages": USER}, list(b"<user>x\n<assistant>"), None),
    ({"messages": USER, "add_generation_prompt": False}, list(b"<user>x\n"), None),
])
async def test_tokenize(client, engine, body, tokens, strs):
    out = await (await client.post("/tokenize", json=body)).json()
    assert out == {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len, "token_strs": strs}


@pytest.mark.parametrize("body, param", [
    ({"messages": USER, "continue_final_message": True}, "continue_final_message"),
    ({"prompt": "x", "return_token_strs": "yes"}, "return_token_strs"),
    ({"prompt": "x", "add_special_tokens": 1}, "add_special_tokens"),
    ({"prompt": "x", "model": "other"}, "model"),
])
async def test_tokenize_refuses(client, body, param):
    resp = await client.post("/tokenize", json=body)
    assert resp.status in (400, 404) and (await resp.json())["error"]["param"] == param


CONTINUED = [*USER, {"role": "assistant", "content": "The"}]


@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
async def test_continue_final_message_ends_the_prompt_inside_it(client, engine, path):
    body = {"messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 1}
    resp = await client.post(path, json=body)
    assert resp.status == 200
    prompt = (await resp.json())["tokens"] if path == "/tokenize" else list(engine.requests[0].prompt_token_ids)
    assert prompt == list(b"<user>x\n<assistant>The")


@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
@pytest.mark.parametrize("messages, flags, param", [
    (CONTINUED, {}, "continue_final_message"),   # add_generation_prompt is true unless set false
    (CONTINUED, {"add_generation_prompt": True}, "continue_final_message"),
])
async def test_continue_final_message_refused(client, engine, path, messages, flags, param):
    resp = await client.post(path, json={"messages": messages, "continue_final_message": True, **flags})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == param
    assert engine.requests == []


@pytest.mark.parametrize("messages, shown", [(CONTINUED, "The"), (USER, "")])
@pytest.mark.parametrize("stream", [False, True])
async def test_chat_echo_starts_the_message_with_the_assistants_final_text(client, messages, shown, stream):
    """vLLM's chat `echo`: the final message's text before the output when it is the assistant's (the whole message
    of a continued one), nothing otherwise; streamed as a chunk after the role's."""
    body = {"messages": messages, "echo": True, "max_tokens": 2, "stream": stream,
            **({"add_generation_prompt": False, "continue_final_message": True} if shown else {})}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    if not stream:
        answer = await resp.json()
        assert answer["choices"][0]["message"]["content"] == shown + "ab"
        assert answer["usage"]["completion_tokens"] == 2
        return
    deltas = [c["choices"][0]["delta"] for c in parse_sse(await resp.text())[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content") or "" for d in deltas) == shown + "ab"
    assert [d.get("content") for d in deltas[1:3]] == ([shown, "a"] if shown else ["a", "b"])


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "xy"}), ("/v1/chat/completions", {
    "messages": CONTINUED, "echo": True, "add_generation_prompt": False, "continue_final_message": True})])
async def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client, engine, path, body):
    """vLLM's `stream_options.continuous_usage_stats` (with include_usage): every chunk carries the usage so far (the
    chat's role and echo chunks 0 output tokens), and the usage chunk ends the stream as always."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    resp = await client.post(path, json={**body, "max_tokens": 3, "stream": True, "stream_options": options})
    chunks = parse_sse(await resp.text())[:-1]
    prompt = len(engine.requests[-1].prompt_token_ids)
    assert all(c["usage"]["prompt_tokens"] == prompt for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    heads = [0, 0] if path == "/v1/chat/completions" else []
    assert counts == [*heads, 1, 2, 3, 3] and chunks[-1]["choices"] == []
    assert all(c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"] for c in chunks)


async def test_usage_in_every_chunk_needs_include_usage(client):
    body = {"prompt": "xy", "max_tokens": 2, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    chunks = parse_sse(await (await client.post("/v1/completions", json=body)).text())[:-1]
    assert all("usage" not in c for c in chunks)


async def test_chat_completions_without_the_generation_prompt(client, engine):
    resp = await client.post("/v1/chat/completions", json={"messages": USER, "add_generation_prompt": False,
                                                          "max_tokens": 1})
    assert resp.status == 200 and engine.requests[0].prompt_token_ids == tuple(b"<user>x\n")


@pytest.mark.parametrize("tokens, prompt", [
    ([104, 105], "hi"),
    ([], ""),
    ([104, 256], "h<256>"),   # special tokens are written out, as transformers' decode does by default
])
async def test_detokenize(client, tokens, prompt):
    resp = await client.post("/detokenize", json={"tokens": tokens})
    assert resp.status == 200 and await resp.json() == {"prompt": prompt}


@pytest.mark.parametrize("body", [{}, {"tokens": "hi"}, {"tokens": [1, "2"]}, {"tokens": [260]}, {"tokens": [-1]},
                                  {"tokens": [True]}])
async def test_detokenize_refuses(client, body):
    resp = await client.post("/detokenize", json=body)
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "tokens"


async def test_tokenizer_info_only_when_enabled(client):
    assert (await client.get("/tokenizer_info")).status == 404
    enabled = TestClient(TestServer(make_app(FakeEngine(), tokenizer_info_endpoint=True)))
    await enabled.start_server()
    try:
        resp = await enabled.get("/tokenizer_info")
        assert resp.status == 200 and (await resp.json())["tokenizer_class"] == "FakeBytes"
    finally:
        await enabled.close()


@pytest.mark.parametrize("path, body, prompt", [
    ("/v1/completions", {"prompt": "abcdef", "truncate_prompt_tokens": 2}, b"ef"),
    ("/v1/completions", {"prompt": [1, 2, 3], "truncate_prompt_tokens": 5}, bytes([1, 2, 3])),
    ("/v1/completions", {"prompt": [1, 2, 3], "truncate_prompt_tokens": -1}, bytes([1, 2, 3])),
    ("/v1/chat/completions", {"messages": USER, "truncate_prompt_tokens": 4}, b"ant>"),
])
async def test_truncate_prompt_tokens_keeps_the_prompts_end(client, engine, path, body, prompt):
    resp = await client.post(path, json=body | {"max_tokens": 1})
    assert resp.status == 200 and engine.requests[0].prompt_token_ids == tuple(prompt)


async def test_a_truncated_prompt_is_echoed_as_served(client):
    resp = await client.post("/v1/completions", json={"prompt": "abcdef", "truncate_prompt_tokens": 2, "echo": True,
                                                      "max_tokens": 0})
    assert (await resp.json())["choices"][0]["text"] == "ef"


@pytest.mark.parametrize("keep", [0, -2, 129, "3", 1.5])
async def test_truncate_prompt_tokens_refused(client, engine, keep):
    resp = await client.post("/v1/completions", json={"prompt": "abc", "truncate_prompt_tokens": keep})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "truncate_prompt_tokens"
    assert engine.requests == []


@pytest.mark.parametrize("field, value", [("include_stop_str_in_output", True), ("skip_special_tokens", False)])
async def test_detokenizing_fields_reach_the_engine(client, engine, field, value):
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, field: value})
    assert resp.status == 200 and getattr(engine.requests[0].sampling, field) is value


async def test_chat_template_kwargs_reach_the_template(client, engine):
    body = {"messages": USER, "chat_template_kwargs": {"thinking": True}}
    out = await (await client.post("/tokenize", json=body)).json()
    assert out["tokens"] == list(b"<user>x\n<assistant><think>")
    resp = await client.post("/v1/chat/completions", json=body | {"max_tokens": 1})
    assert resp.status == 200 and engine.requests[0].prompt_token_ids == tuple(b"<user>x\n<assistant><think>")


@pytest.mark.parametrize("kwargs", [[1], "thinking", {"messages": []}, {"bos_token": "x"}])
async def test_chat_template_kwargs_refused(client, engine, kwargs):
    resp = await client.post("/v1/chat/completions", json={"messages": USER, "chat_template_kwargs": kwargs})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "chat_template_kwargs"
    assert engine.requests == []


@pytest.mark.parametrize("stream", [False, True])
async def test_return_tokens_as_token_ids_names_every_logprob_token_by_id(client, stream):
    body = {"prompt": "x", "max_tokens": 2, "logprobs": 1, "echo": True, "return_tokens_as_token_ids": True,
            "stream": stream}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    if stream:
        chunks = parse_sse(await resp.text())[:-1]
        tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    else:
        tokens = (await resp.json())["choices"][0]["logprobs"]["tokens"]
    assert tokens == [f"token_id:{ord('x')}", "token_id:97", "token_id:98"]


async def test_return_tokens_as_token_ids_in_chat(client):
    body = {"messages": USER, "max_tokens": 1, "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True}
    content = (await (await client.post("/v1/chat/completions", json=body)).json())["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == "token_id:97" and content[0]["bytes"] == list(b"token_id:97")
    assert content[0]["top_logprobs"][0]["token"] == "token_id:97"


@pytest.mark.parametrize("words, sequences", [
    (["no"], ((110, 111),)),                       # " no" is three bytes here: not the same count, left out
    (["  ab", "ab"], ((97, 98),)),                  # a word's leading spaces go; one sequence once
])
async def test_bad_words_reach_the_engine_as_token_sequences(client, engine, words, sequences):
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "bad_words": words})
    assert resp.status == 200 and engine.requests[0].sampling.bad_words_token_ids == sequences
