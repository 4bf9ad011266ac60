"""Fuzzed JSON bodies: never a 5xx, and the node answers /health 200 afterwards."""

from __future__ import annotations

import asyncio
import json

from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import MODEL, make_app
from .fake_engine import FakeEngine

SCALARS = (
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, 2, -1, 16, 127, 128, 259, 260, 2**63, 10**30])
    | st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([0.0, 1e-9, 0.5, 1.0, 1.5, 1e308])
    | st.text(max_size=12) | st.sampled_from(["", MODEL, "x", "\x00", "\ud7ff"])
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
TOKEN_LISTS = st.lists(st.integers(min_value=-3, max_value=262), max_size=8)
MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "system", "assistant", "tool", "bot"]) | JSON,
        "content": st.text(max_size=12) | st.lists(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | JSON,
                                   "text": st.text(max_size=8) | JSON}), max_size=3) | JSON,
    },
)
SAMPLING = {
    "model": st.sampled_from([MODEL, "other"]) | JSON,
    "max_tokens": st.integers(min_value=-2, max_value=200) | JSON,
    "temperature": st.floats(min_value=-1, max_value=3, allow_nan=False) | JSON,
    "top_p": st.floats(min_value=-0.5, max_value=1.5, allow_nan=False) | JSON,
    "top_k": st.integers(min_value=-3, max_value=10**6) | JSON,
    "seed": st.integers(min_value=-(2**65), max_value=2**65) | JSON,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3) | JSON,
    "ignore_eos": st.booleans() | JSON,
    "logprobs": st.integers(min_value=-1, max_value=25) | st.booleans() | JSON,
    "top_logprobs": st.integers(min_value=-1, max_value=25) | JSON,
    "n": st.sampled_from([1, 2]) | JSON,
    "echo": st.booleans() | JSON,
    "prompt_logprobs": st.integers(min_value=-2, max_value=25) | JSON,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | JSON}) | JSON,
    "return_token_ids": st.booleans() | JSON,
    "kv_transfer_params": st.fixed_dictionaries({}, optional={
        "do_remote_decode": st.booleans() | JSON, "do_remote_prefill": st.booleans() | JSON,
        "remote_block_ids": st.lists(TOKEN_LISTS, max_size=3) | JSON, "remote_port": st.integers() | JSON,
    }) | JSON,
    "max_completion_tokens": st.integers(min_value=-2, max_value=200) | JSON,
}
# Mostly valid bodies with at most one field replaced by anything: these reach the engine and the answer paths.
VALID = {
    "model": st.just(MODEL), "max_tokens": st.integers(min_value=1, max_value=8),
    "temperature": st.floats(min_value=0, max_value=2), "top_p": st.floats(min_value=0.01, max_value=1),
    "top_k": st.integers(min_value=-1, max_value=300), "seed": st.integers(min_value=0, max_value=2**32),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2), "ignore_eos": st.booleans(),
    "logprobs": st.integers(min_value=0, max_value=5), "stream": st.booleans(), "return_token_ids": st.booleans(),
}
VALID_CHAT = {**VALID, "logprobs": st.booleans(), "max_completion_tokens": st.integers(min_value=1, max_value=8),
              "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans()}


def _mutated(required: dict, valid: dict) -> st.SearchStrategy[dict]:
    keys = sorted({*required, *valid, *SAMPLING})

    def override(parts: tuple[dict, str, object, bool]) -> dict:
        body, key, value, replace = parts
        return {**body, key: value} if replace else body

    base = st.fixed_dictionaries(required, optional=valid)
    return st.tuples(base, st.sampled_from(keys), JSON, st.booleans()).map(override)


NEAR_VALID_COMPLETION = _mutated({"prompt": st.text(min_size=1, max_size=20) | st.lists(
    st.integers(min_value=0, max_value=259), min_size=1, max_size=8)}, VALID)
NEAR_VALID_CHAT = _mutated({"messages": st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=12)}), min_size=1,
    max_size=3)}, VALID_CHAT)
COMPLETION_BODY = st.fixed_dictionaries(
    {}, optional={"prompt": st.text(max_size=20) | TOKEN_LISTS | st.lists(st.text(max_size=5), max_size=2) | JSON,
                  **SAMPLING},
)
CHAT_BODY = st.fixed_dictionaries({}, optional={"messages": st.lists(MESSAGE, max_size=3) | JSON, **SAMPLING})
ANY_BODY = JSON.map(lambda value: json.dumps(value).encode()) | st.binary(max_size=40)
PART = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image"]) | JSON,
                              "text": st.text(max_size=8) | JSON})
ITEM = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "web_search_call"])
    | JSON,
    "role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]) | JSON,
    "content": st.text(max_size=12) | st.lists(PART, max_size=3) | JSON,
    "call_id": st.sampled_from(["c1", "c2"]) | JSON, "name": st.sampled_from(["add", "now"]) | JSON,
    "arguments": st.sampled_from(['{"a": 1}', "{", ""]) | JSON, "output": st.text(max_size=6) | JSON,
    "status": st.sampled_from(["completed", "incomplete", "in_progress"]) | JSON,
})
RESPONSES_FIELDS = {
    "input": st.text(max_size=20) | st.lists(ITEM, max_size=4) | JSON,
    "instructions": st.text(max_size=10) | JSON,
    "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]) | JSON},
                                            optional={"name": st.sampled_from(["add", "now", ""]) | JSON,
                                                      "parameters": st.just({"type": "object"}) | JSON}),
                      max_size=3) | JSON,
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "name": "add"}]) | JSON,
    "text": st.fixed_dictionaries({}, optional={"format": st.sampled_from(
        [{"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "schema": {"type": "object"}}]) | JSON})
    | JSON,
    "include": st.just(["message.output_text.logprobs"]) | JSON, "max_output_tokens": st.integers(-2, 200) | JSON,
    "truncation": st.sampled_from(["auto", "disabled"]) | JSON, "metadata": JSON, "user": JSON, "store": JSON,
    "previous_response_id": JSON, "background": JSON, "service_tier": JSON, "reasoning": JSON,
}
VALID_RESPONSES = {**{k: v for k, v in VALID.items() if k not in ("max_tokens", "logprobs", "return_token_ids")},
                   "max_output_tokens": st.integers(min_value=1, max_value=8)}
NEAR_VALID_RESPONSES = _mutated({"input": st.text(min_size=1, max_size=20) | st.lists(ITEM, min_size=1, max_size=4)},
                                VALID_RESPONSES)
RESPONSES_BODY = st.fixed_dictionaries({}, optional={**RESPONSES_FIELDS, **SAMPLING})
BLOCK = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image", "tool_addition"]) | JSON,
    "text": st.text(max_size=8) | JSON, "id": st.sampled_from(["t1", "t2"]) | JSON,
    "tool_use_id": st.sampled_from(["t1", "t2"]) | JSON, "name": st.sampled_from(["add", "now", ""]) | JSON,
    "input": st.just({"a": 1}) | JSON,
    "content": st.text(max_size=6) | st.lists(st.fixed_dictionaries({"type": st.just("text") | JSON,
                                                                     "text": st.text(max_size=4) | JSON}),
                                              max_size=2) | JSON,
})
ANTHROPIC_MESSAGE = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["user", "assistant", "system", "tool"]) | JSON,
    "content": st.text(max_size=12) | st.lists(BLOCK, max_size=3) | JSON,
})
MESSAGES_FIELDS = {
    "messages": st.lists(ANTHROPIC_MESSAGE, max_size=4) | JSON,
    "system": st.text(max_size=10) | st.lists(BLOCK, max_size=2) | JSON,
    "tools": st.lists(st.fixed_dictionaries({}, optional={
        "name": st.sampled_from(["add", "now", ""]) | JSON, "input_schema": st.just({"type": "object"}) | JSON,
        "type": st.sampled_from(["custom", "web_search_20250305"]) | JSON}), max_size=3) | JSON,
    "tool_choice": st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(["auto", "any", "none", "tool"]) | JSON, "name": st.sampled_from(["add", "x"]) | JSON,
        "disable_parallel_tool_use": st.booleans() | JSON}) | JSON,
    "stop_sequences": st.lists(st.text(max_size=3), max_size=3) | JSON,
    "output_config": st.fixed_dictionaries({}, optional={"format": st.sampled_from(
        [{"type": "json_schema", "schema": {"type": "object"}}, {"type": "json_schema"}]) | JSON,
        "effort": st.sampled_from(["low", "max"]) | JSON}) | JSON,
    "thinking": st.fixed_dictionaries({}, optional={"type": st.sampled_from(["enabled", "disabled", "adaptive"]) | JSON,
                                                    "budget_tokens": st.integers(0, 3000) | JSON}) | JSON,
    "metadata": JSON,
}
VALID_MESSAGES = {k: v for k, v in VALID.items()
                  if k not in ("model", "max_tokens", "logprobs", "return_token_ids", "seed", "ignore_eos")}
NEAR_VALID_MESSAGES = _mutated({"model": st.just(MODEL), "max_tokens": st.integers(min_value=1, max_value=8),
                                "messages": st.lists(ANTHROPIC_MESSAGE, min_size=1, max_size=3)}, VALID_MESSAGES)
MESSAGES_BODY = st.fixed_dictionaries({}, optional={**MESSAGES_FIELDS, **SAMPLING})


async def _post_and_check(client: TestClient, path: str, data: bytes) -> None:
    resp = await client.post(path, data=data, headers={"Content-Type": "application/json"})
    text = await resp.text()
    assert resp.status < 500, (resp.status, data[:300], text[:300])
    if resp.status >= 400:
        body = json.loads(text)
        error = body["error"]
        if path.startswith("/v1/messages"):   # Anthropic's shape
            assert body["type"] == "error" and isinstance(error["type"], str)
        else:
            assert error["code"] == resp.status
        assert isinstance(error["message"], str)


async def _start_client() -> TestClient:
    client = TestClient(TestServer(make_app(FakeEngine())))
    await client.start_server()
    return client


def _fuzz(path: str, bodies: st.SearchStrategy[bytes], examples: int) -> None:
    with asyncio.Runner() as runner:
        client = runner.run(_start_client())
        try:
            @settings(max_examples=examples, deadline=None, derandomize=True,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
            @given(data=bodies)
            def check(data: bytes) -> None:
                runner.run(_post_and_check(client, path, data))

            check()
            health = runner.run(client.get("/health"))
            assert health.status == 200
            ok = runner.run(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}))
            assert ok.status == 200 and runner.run(ok.json())["choices"][0]["text"] == "ab"
        finally:
            runner.run(client.close())


def _encode(body: dict) -> bytes:
    return json.dumps(body).encode()


def test_fuzz_completions():
    _fuzz("/v1/completions", (NEAR_VALID_COMPLETION | COMPLETION_BODY).map(_encode) | ANY_BODY, examples=300)


def test_fuzz_chat_completions():
    _fuzz("/v1/chat/completions", (NEAR_VALID_CHAT | CHAT_BODY).map(_encode) | ANY_BODY, examples=300)


def test_fuzz_responses():
    _fuzz("/v1/responses", (NEAR_VALID_RESPONSES | RESPONSES_BODY).map(_encode) | ANY_BODY, examples=300)


def test_fuzz_messages():
    _fuzz("/v1/messages", (NEAR_VALID_MESSAGES | MESSAGES_BODY).map(_encode) | ANY_BODY, examples=300)


def test_fuzz_count_message_tokens():
    _fuzz("/v1/messages/count_tokens", (NEAR_VALID_MESSAGES | MESSAGES_BODY).map(_encode) | ANY_BODY, examples=100)


def test_fuzz_tokenize():
    _fuzz("/tokenize", COMPLETION_BODY.map(_encode) | CHAT_BODY.map(_encode) | ANY_BODY, examples=100)
