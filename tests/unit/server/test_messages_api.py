"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the HTTP server, a fake engine
spelling a given answer: every answer and event read by the `anthropic` package's own types (what its clients parse),
streamed and whole answers alike, the engine asked for the chat request the body means, and bad bodies refused in
Anthropic's error shape, naming the field."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from hybridpd.engine.output_constraint import ConstraintKind
from hybridpd.engine.tokenizer import ChatTemplate
from hybridpd.errors import InvalidRequestError
from hybridpd.server.message_request import needs_system_first
from hybridpd.server.tool_fields import ToolParsing

from .conftest import MODEL, make_app, typed_events
from .fake_engine import ByteTokenizer, FakeEngine

MESSAGES = "/v1/messages"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
ADD = {"name": "add", "description": "Adds.", "input_schema": SCHEMA}
NOW = {"name": "now", "input_schema": {"properties": {}}}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
EVENTS = TypeAdapter(RawMessageStreamEvent)
ASK = {"model": MODEL, "max_tokens": 300, "messages": [{"role": "user", "content": "What is 1 + 2?"}]}


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(max_model_len=512)


async def _client(engine: FakeEngine, **config: Any) -> TestClient:
    client = TestClient(TestServer(make_app(engine, **config)))
    await client.start_server()
    return client


@pytest.fixture
async def client(engine: FakeEngine) -> AsyncIterator[TestClient]:
    client = await _client(engine, tool_parsing=ToolParsing(auto=True, parser="granite4"))
    try:
        yield client
    finally:
        await client.close()


async def _whole(client: TestClient, body: dict[str, Any]) -> Message:
    resp = await client.post(MESSAGES, json={**ASK, **body})
    assert resp.status == 200, await resp.text()
    return Message.model_validate(await resp.json())


async def _streamed(client: TestClient, body: dict[str, Any]) -> list[Any]:
    resp = await client.post(MESSAGES, json={**ASK, "stream": True, **body})
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    return [EVENTS.validate_python(event) for event in typed_events(await resp.text())]


def _view(content: list[Any]) -> list[tuple[Any, ...]]:
    """What a client reads of a message's content, without the ids made up per answer."""
    return [("text", block.text) if block.type == "text" else ("tool_use", block.name, block.input)
            for block in content]


def _stream_view(events: list[Any]) -> list[tuple[Any, ...]]:
    """The blocks a stream built, as `_view` shows a whole message's."""
    blocks: dict[int, list[Any]] = {}
    for event in events:
        if event.type == "content_block_start":
            block = event.content_block
            blocks[event.index] = ["text", ""] if block.type == "text" else ["tool_use", block.name, ""]
        elif event.type == "content_block_delta":
            delta = event.delta
            blocks[event.index][-1] += delta.text if delta.type == "text_delta" else delta.partial_json
    return [tuple(b) if b[0] == "text" else (b[0], b[1], json.loads(b[2] or "{}")) for _, b in sorted(blocks.items())]


ONE_TWO = {"a": 1, "b": 2}


@pytest.mark.parametrize("spells, stop_reason, body, view, reason, sequence", [
    ("3", None, {}, [("text", "3")], "end_turn", None),
    ("3", 256, {}, [("text", "3")], "end_turn", None),
    ("3 END", "END", {"stop_sequences": ["END"]}, [("text", "3 END")], "stop_sequence", "END"),
    ("abcdef", None, {"max_tokens": 3}, [("text", "abc")], "max_tokens", None),
    ("3", None, {"tools": [ADD, NOW], "tool_choice": {"type": "none"}}, [("text", "3")], "end_turn", None),
    ("Sure." + CALL, None, {"tools": [ADD, NOW]}, [("text", "Sure."), ("tool_use", "add", ONE_TWO)], "tool_use",
     None),
    (CALL + CALL, None, {"tools": [ADD], "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
     [("tool_use", "add", ONE_TWO)], "tool_use", None),
    ('{"a": 1, "b": 2}', None, {"tools": [ADD, NOW], "tool_choice": {"type": "tool", "name": "add"}},
     [("tool_use", "add", ONE_TWO)], "tool_use", None),
    ('[{"name": "now", "parameters": {}}]', None, {"tools": [ADD, NOW], "tool_choice": {"type": "any"}},
     [("tool_use", "now", {})], "tool_use", None),
])
async def test_whole_and_streamed_answers_show_the_same_message(client: TestClient, engine: FakeEngine, spells: str,
                                                                stop_reason: Any, body: dict, view: list, reason: str,
                                                                sequence: str | None) -> None:
    engine.spells, engine.stop_reason = spells, stop_reason
    whole = await _whole(client, body)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.model == MODEL
    assert _view(whole.content) == view
    assert (whole.stop_reason, whole.stop_sequence) == (reason, sequence)
    prompt = len(engine.requests[-1].prompt_token_ids)
    output_tokens = min(len(spells), body.get("max_tokens", 300))
    assert whole.usage.model_dump(exclude_none=True) == {"input_tokens": prompt, "output_tokens": output_tokens,
                                                         "cache_read_input_tokens": 0}

    events = await _streamed(client, body)
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    start = events[0].message
    assert start.id.startswith("msg_") and start.content == [] and start.stop_reason is None
    assert (start.usage.input_tokens, start.usage.output_tokens) == (prompt, 0)
    assert _stream_view(events) == view
    delta = events[-2]
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == (reason, sequence)
    assert delta.usage.output_tokens == output_tokens and delta.usage.input_tokens == prompt
    # every block opens, takes its deltas and closes before the next one opens
    opened = [e.index for e in events if e.type == "content_block_start"]
    assert opened == list(range(len(view)))
    blocks = [(e.type, e.index) for e in events if e.type.startswith("content_block")]
    assert [kind for kind, _ in blocks if kind != "content_block_delta"] == [
        "content_block_start", "content_block_stop"] * len(view)
    assert [index for _, index in blocks] == sorted(index for _, index in blocks)


async def test_a_call_cut_by_the_length_is_text_in_a_whole_answer(client: TestClient, engine: FakeEngine) -> None:
    """Arguments that are not a whole object cannot be a tool_use block's `input`: the whole answer shows them as the
    text the model wrote; a stream has sent them as the block's partial JSON already. Both end on max_tokens."""
    engine.spells = '{"a": 1, "b": 2}'
    body = {"max_tokens": 5, "tools": [ADD], "tool_choice": {"type": "tool", "name": "add"}}
    whole = await _whole(client, body)
    assert _view(whole.content) == [("text", '{"a":')] and whole.stop_reason == "max_tokens"
    events = await _streamed(client, body)
    assert "".join(e.delta.partial_json for e in events if e.type == "content_block_delta") == '{"a":'
    assert events[-2].delta.stop_reason == "max_tokens"


async def test_text_after_a_call_follows_it_as_a_block_of_its_own(client: TestClient, engine: FakeEngine) -> None:
    """Text the model writes while a call is open waits for the call's block to close, as vLLM holds it."""
    engine.spells = "A" + CALL + "B" + CALL
    events = await _streamed(client, {"tools": [ADD]})
    kinds = [(e.type, getattr(e, "index", None)) for e in events
             if e.type in ("content_block_start", "content_block_stop")]
    assert kinds == [("content_block_start", 0), ("content_block_stop", 0), ("content_block_start", 1),
                     ("content_block_stop", 1), ("content_block_start", 2), ("content_block_stop", 2),
                     ("content_block_start", 3), ("content_block_stop", 3)]
    assert _stream_view(events) == [("text", "A"), ("tool_use", "add", ONE_TWO), ("text", "B"),
                                    ("tool_use", "add", ONE_TWO)]


async def test_an_empty_answer_is_one_empty_text_block(client: TestClient, engine: FakeEngine) -> None:
    engine.textless_outputs = frozenset({0})
    whole = await _whole(client, {"max_tokens": 1})
    assert _view(whole.content) == [("text", "")] and whole.stop_reason == "max_tokens"
    events = await _streamed(client, {"max_tokens": 1})
    assert [e.type for e in events] == ["message_start", "message_delta", "message_stop"]


async def test_cached_prompt_tokens_are_cache_reads(client: TestClient, engine: FakeEngine) -> None:
    engine.spells, engine.num_cached_tokens = "3", 16
    whole = await _whole(client, {})
    prompt = len(engine.requests[-1].prompt_token_ids)
    assert (whole.usage.input_tokens, whole.usage.cache_read_input_tokens) == (prompt - 16, 16)


def _chat_prompt_of(engine: FakeEngine) -> bytes:
    return bytes(t for t in engine.requests[-1].prompt_token_ids if t < 256)


async def test_the_conversation_is_the_one_chat_would_render(client: TestClient, engine: FakeEngine) -> None:
    """system blocks (the billing line left out), a user's text blocks, an assistant's thinking, text and two calls,
    the user's tool results and text: the prompt of the chat body that says the same."""
    engine.spells = "3"
    await _whole(client, {"tools": [ADD], "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=ab12;"},
        {"type": "text", "text": "Add. "}, {"type": "text", "text": "Be brief."}], "messages": [
        {"role": "user", "content": [{"type": "text", "text": "1 + 2"}, {"type": "text", "text": "?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "s"}, {"type": "text", "text": "Calling."},
            {"type": "tool_use", "id": "c1", "name": "add", "input": {"a": 1, "b": 2}},
            {"type": "tool_use", "id": "c2", "name": "add", "input": {"a": 2, "b": 1}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "c1", "content": "3"},
            {"type": "tool_result", "tool_use_id": "c2", "content": [{"type": "text", "text": "3"}]},
            {"type": "text", "text": "Both?"}]},
    ]})
    messages_prompt = _chat_prompt_of(engine)
    calls = [{"id": c, "type": "function", "function": {"name": "add", "arguments": a}}
             for c, a in (("c1", '{"a": 1, "b": 2}'), ("c2", '{"a": 2, "b": 1}'))]
    resp = await client.post("/v1/chat/completions", json={"max_tokens": 300, "tools": [
        {"type": "function", "function": {"name": "add", "description": "Adds.", "parameters": SCHEMA}}], "messages": [
        {"role": "system", "content": "Add. Be brief."}, {"role": "user", "content": "1 + 2\n?"},
        {"role": "assistant", "content": "Calling.", "tool_calls": calls},
        {"role": "tool", "content": "3", "tool_call_id": "c1"}, {"role": "tool", "content": "3", "tool_call_id": "c2"},
        {"role": "user", "content": "Both?"},
    ]})
    assert resp.status == 200, await resp.text()
    assert _chat_prompt_of(engine) == messages_prompt
    assert messages_prompt.startswith(b"<tools>add\n<system>Add. Be brief.\n<user>1 + 2\n?\n<assistant>Calling.\n")


async def test_sampling_and_output_format_reach_the_engine(client: TestClient, engine: FakeEngine) -> None:
    engine.spells = '{"a": 1}'
    await _whole(client, {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "stop_sequences": ["\n\n"],
                          "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}, "effort": "low"},
                          "thinking": {"type": "adaptive"}, "metadata": {"user_id": "u"}})
    sampling = engine.requests[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_tokens) == (0.5, 0.9, 7, 300)
    assert sampling.stop == ("\n\n",)
    assert sampling.constraint is not None and sampling.constraint.kind is ConstraintKind.JSON
    assert json.loads(sampling.constraint.spec) == SCHEMA


async def test_count_tokens_counts_the_prompt_a_message_would_have(client: TestClient, engine: FakeEngine) -> None:
    body = {"model": MODEL, "system": "Be brief.", "tools": [ADD], "messages": ASK["messages"]}
    resp = await client.post("/v1/messages/count_tokens", json=body)
    assert resp.status == 200, await resp.text()
    counted = await resp.json()
    engine.spells = "3"
    await _whole(client, {"system": "Be brief.", "tools": [ADD]})
    prompt = len(engine.requests[-1].prompt_token_ids)
    assert counted == {"input_tokens": prompt, "context_management": {"original_input_tokens": prompt}}


async def test_auto_tools_without_the_parser_flags_are_refused_as_vllm_refuses_them(engine: FakeEngine) -> None:
    client = await _client(engine)
    try:
        resp = await client.post(MESSAGES, json={**ASK, "tools": [ADD]})
        assert resp.status == 400
        assert "--enable-auto-tool-choice" in (await resp.json())["error"]["message"]
        engine.spells = "3"
        assert _view((await _whole(client, {"tools": [ADD], "tool_choice": {"type": "none"}})).content) == [
            ("text", "3")]
    finally:
        await client.close()


async def test_a_failure_after_the_stream_started_is_an_error_event(client: TestClient, engine: FakeEngine) -> None:
    engine.fail_at_output = 2
    resp = await client.post(MESSAGES, json={**ASK, "stream": True})
    events = typed_events(await resp.text())
    assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "api_error"
    assert "lease expired" in events[-1]["error"]["message"]
    assert [e["type"] for e in events].count("content_block_delta") == 2
    assert EVENTS.validate_python(events[0]).type == "message_start"


async def test_prefill_answers_carry_kv_transfer_params(client: TestClient, engine: FakeEngine) -> None:
    engine.kv_transfer_params = {"remote_engine_id": "e", "remote_block_ids": [1]}
    resp = await client.post(MESSAGES, json={**ASK, "max_tokens": 1})
    assert (await resp.json())["kv_transfer_params"] == engine.kv_transfer_params
    engine.kv_transfer_params = None
    assert "kv_transfer_params" not in await (await client.post(MESSAGES, json={**ASK, "max_tokens": 1})).json()


@pytest.mark.parametrize("body, status, param", [
    ({"model": None}, 400, "model"),
    ({"model": "another"}, 404, "another"),
    ({"max_tokens": None}, 400, "max_tokens"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": 5000}, 400, "max_tokens"),
    ({"max_tokens": True}, 400, "max_tokens"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages[0].content[0].text"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "c", "input": {}}]}]}, 400,
     "messages[0].content[0].name"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "c", "name": "f", "input": 3}]}]},
     400, "messages[0].content[0].input"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c",
                                                 "content": [{"type": "image"}]}]}]}, 400,
     "messages[0].content[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_addition", "tool": {}}]}]}, 400,
     "messages[0].content[0]"),
    ({"system": 3}, 400, "system"),
    ({"stop_sequences": "END"}, 400, "stop_sequences"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools[0]"),
    ({"tools": [{"name": "f"}]}, 400, "tools[0].input_schema"),
    ({"tools": [ADD, ADD]}, 400, "tools"),
    ({"tool_choice": {"type": "sometimes"}}, 400, "tool_choice"),
    ({"tools": [ADD], "tool_choice": {"type": "tool"}}, 400, "tool_choice.name"),
    ({"tools": [ADD], "tool_choice": {"type": "tool", "name": "sub"}}, 400, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, 400, "tool_choice"),
    ({"output_config": {"format": {"type": "xml"}}}, 400, "output_config.format"),
    ({"output_config": {"effort": "extreme"}}, 400, "output_config.effort"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, 400, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, 400, "thinking.budget_tokens"),
    ({"thinking": {"type": "on"}}, 400, "thinking"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"stream": "yes"}, 400, "stream"),
])
async def test_bad_bodies_are_refused_in_anthropics_shape(client: TestClient, engine: FakeEngine, body: dict,
                                                          status: int, param: str) -> None:
    resp = await client.post(MESSAGES, json={**ASK, **body})
    assert resp.status == status, await resp.text()
    error = await resp.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert param in error["error"]["message"]
    assert engine.requests == []


async def test_a_body_that_is_not_json_is_refused_in_anthropics_shape(client: TestClient) -> None:
    for path in (MESSAGES, "/v1/messages/count_tokens"):
        resp = await client.post(path, data=b"{", headers={"Content-Type": "application/json"})
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "invalid_request_error"


class SystemFirstTokenizer(ByteTokenizer):
    """A template that refuses a system message after the first (as Qwen's do)."""

    def apply_chat_template(self, messages, add_generation_prompt=True, template_kwargs=None, tools=None):
        if any(m["role"] == "system" for m in messages[1:]):
            raise InvalidRequestError("chat template: System message must be at the beginning.", "messages")
        return super().apply_chat_template(messages, add_generation_prompt, template_kwargs, tools)


@pytest.mark.parametrize("system_first, prompt", [
    (False, b"<system>A\n<user>hi\n<system>B\n<user>again\n<assistant>"),
    (True, b"<system>AB\n<user>hi\n<user>again\n<assistant>"),   # joined into the first, as vLLM joins them
])
async def test_inline_system_messages_are_joined_when_the_template_needs_them_first(system_first: bool,
                                                                                    prompt: bytes) -> None:
    engine = FakeEngine(max_model_len=512, tokenizer=SystemFirstTokenizer() if system_first else ByteTokenizer())
    engine.spells = "3"
    client = await _client(engine)
    body = {"system": "A", "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "B"},
                                        {"role": "user", "content": "again"}]}
    try:
        await _whole(client, body)
        assert bytes(engine.requests[-1].prompt_token_ids) == prompt
        counted = await (await client.post("/v1/messages/count_tokens", json={"model": MODEL, **body})).json()
        assert counted["input_tokens"] == len(prompt)
    finally:
        await client.close()


QWEN_LIKE = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
             "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
             "<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}")


@pytest.mark.parametrize("source, first", [(QWEN_LIKE, True), (QWEN_LIKE.replace("and not loop.first", "and false"),
                                                               False)])
def test_a_template_that_needs_the_system_prompt_first_is_found(source: str, first: bool) -> None:
    template = ChatTemplate(source, {})

    class Rendering:
        def apply_chat_template(self, messages, add_generation_prompt=True, template_kwargs=None, tools=None):
            return template.render(messages, add_generation_prompt, template_kwargs, tools)

    assert needs_system_first(Rendering()) is first
