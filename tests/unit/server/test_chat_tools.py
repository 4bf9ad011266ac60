"""Chat requests with tools through the HTTP server (a fake engine spelling a given answer): what the engine is asked
for (the tools in the prompt, the constraint, special tokens kept for the parser) and the answer a client reads,
whole or streamed, as vLLM shapes it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from hybridpd.engine.output_constraint import ConstraintKind
from hybridpd.server.protocol import parse_messages
from hybridpd.server.tool_fields import ToolParsing

from .conftest import make_app, parse_sse
from .fake_engine import FakeEngine

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "What is 1 + 2?"}]
PARAMS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": PARAMS}}
NOW = {"type": "function", "function": {"name": "now"}}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(max_model_len=512)


@pytest.fixture
async def tools_client(engine: FakeEngine) -> AsyncIterator[TestClient]:
    client = TestClient(TestServer(make_app(engine, tool_parsing=ToolParsing(auto=True, parser="granite4"))))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


async def _answer(client: TestClient, body: dict) -> dict:
    resp = await client.post(CHAT, json={"messages": USER, "max_tokens": 300, **body})
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def _streamed(client: TestClient, body: dict) -> tuple[str, list[dict], str, list[dict]]:
    """The content, the calls (put together from their pieces, as a client does), the finish reason, and the
    chunks of a streamed answer."""
    resp = await client.post(CHAT, json={"messages": USER, "max_tokens": 300, "stream": True, **body})
    assert resp.status == 200, await resp.text()
    events = parse_sse(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    content, calls, reason = "", {}, None
    for chunk in chunks:
        choice = chunk["choices"][0]
        content += choice["delta"].get("content") or ""
        for piece in choice["delta"].get("tool_calls", []):
            if "id" in piece:
                calls[piece["index"]] = {"id": piece["id"], "type": piece["type"],
                                         "function": {"name": piece["function"]["name"], "arguments": ""}}
            calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
        reason = choice["finish_reason"] or reason
    return content, [calls[i] for i in sorted(calls)], reason, chunks


def _without_ids(calls: list[dict]) -> list[dict]:
    return [{**c, "id": None} for c in calls]


@pytest.mark.parametrize("spells, body, content, calls, reason", [
    # auto: the model's own format, read by the granite4 parser
    ("Sure." + CALL, {"tools": [ADD, NOW]}, "Sure.", [("add", '{"a": 1, "b": 2}')], "tool_calls"),
    ("3", {"tools": [ADD, NOW], "tool_choice": "auto"}, "3", [], "stop"),
    (CALL + CALL, {"tools": [ADD], "parallel_tool_calls": False}, None, [("add", '{"a": 1, "b": 2}')], "tool_calls"),
    # constrained: the output is the call
    ('{"a": 1, "b": 2}', {"tools": [ADD, NOW], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "",
     [("add", '{"a": 1, "b": 2}')], "stop"),
    ('[{"name": "now", "parameters": {}}, {"name": "add", "parameters": {"a": 1}}]',
     {"tools": [ADD, NOW], "tool_choice": "required"}, "", [("now", "{}"), ("add", '{"a": 1}')], "tool_calls"),
    # none: tools are shown, the answer is text
    (CALL, {"tools": [ADD], "tool_choice": "none"}, CALL, [], "stop"),
])
async def test_answers_whole_and_streamed(tools_client, engine, spells, body, content, calls, reason):
    engine.spells = spells
    answer = await _answer(tools_client, body)
    choice = answer["choices"][0]
    message = choice["message"]
    assert message["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])] == calls
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in message.get("tool_calls", []))
    assert choice["finish_reason"] == reason
    streamed_content, streamed_calls, streamed_reason, _ = await _streamed(tools_client, body)
    assert streamed_content == (content or "")
    assert _without_ids(streamed_calls) == _without_ids(message.get("tool_calls", []))
    assert streamed_reason == reason


async def test_the_engine_sees_the_tools_in_the_prompt_and_the_constraint(tools_client, engine):
    engine.spells = '{"a": 1}'
    await _answer(tools_client, {"tools": [ADD, NOW], "tool_choice": {"type": "function", "function": {"name": "add"}},
                                 "response_format": {"type": "json_object"}})
    await _answer(tools_client, {"tools": [ADD, NOW]})
    await _answer(tools_client, {"tools": [ADD, NOW], "tool_choice": "none"})
    named, auto, none = engine.requests
    assert bytes(named.prompt_token_ids).decode().startswith("<tools>add,now\n<user>")
    # the named tool's parameters take the place of response_format, as in vLLM
    assert named.sampling.constraint.kind is ConstraintKind.JSON
    assert json.loads(named.sampling.constraint.spec) == PARAMS
    assert auto.sampling.constraint is None and auto.sampling.skip_special_tokens is False
    assert none.sampling.constraint is None and none.sampling.skip_special_tokens is True


async def test_tokenize_renders_the_tools_as_chat_does(tools_client, engine):
    engine.spells = "3"
    await _answer(tools_client, {"tools": [ADD, NOW]})
    resp = await tools_client.post("/tokenize", json={"messages": USER, "tools": [ADD, NOW]})
    assert (await resp.json())["tokens"] == list(engine.requests[0].prompt_token_ids)


async def test_several_choices_each_read_their_calls(tools_client, engine):
    engine.spells = CALL
    answer = await _answer(tools_client, {"tools": [ADD], "n": 2})
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    for choice in answer["choices"]:
        assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "b": 2}'
        assert choice["finish_reason"] == "tool_calls"
    ids = {c["message"]["tool_calls"][0]["id"] for c in answer["choices"]}
    assert len(ids) == 2


async def test_a_call_cut_short_stays_content(tools_client, engine):
    engine.spells = CALL
    answer = await _answer(tools_client, {"tools": [ADD], "max_tokens": 20})
    assert answer["choices"][0]["message"]["content"] == CALL[:20]
    assert "tool_calls" not in answer["choices"][0]["message"]
    assert answer["choices"][0]["finish_reason"] == "length"


async def test_auto_without_the_flags_is_refused(client):
    resp = await client.post(CHAT, json={"messages": USER, "tools": [ADD]})
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == "tool_choice" and "--enable-auto-tool-choice" in error["message"]


async def test_constrained_choices_need_no_parser(client, engine):
    engine.spells = '{"a": 1}'
    answer = await _answer(client, {"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert answer["choices"][0]["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1}'}


async def test_named_choice_beside_structured_outputs_is_refused(tools_client):
    resp = await tools_client.post(CHAT, json={"messages": USER, "tools": [ADD], "tool_choice": "required",
                                               "structured_outputs": {"regex": "a+"}})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "tool_choice"


def test_history_messages_keep_their_calls_and_ids():
    messages = parse_messages([
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "name": "add", "content": "3"},
    ])
    assert messages == [
        {"role": "user", "content": "add 1 and 2"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "content": "3", "name": "add", "tool_call_id": "call-1"},
    ]
