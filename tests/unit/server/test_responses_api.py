"""The Responses API (`/v1/responses`) through the HTTP server, a fake engine spelling a given answer: every answer and
event read by the `openai` package's own types (what its clients parse), the engine asked for the chat request the
body means, streamed and whole answers alike, and bad bodies refused naming the Responses field."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from hybridpd.engine.output_constraint import ConstraintKind
from hybridpd.server.tool_fields import ToolParsing

from .conftest import make_app, typed_events
from .fake_engine import FakeEngine

RESPONSES = "/v1/responses"
PARAMS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
ADD = {"type": "function", "name": "add", "parameters": PARAMS}
NOW = {"type": "function", "name": "now"}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
EVENTS = TypeAdapter(ResponseStreamEvent)


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


async def _whole(client: TestClient, body: dict[str, Any]) -> Response:
    resp = await client.post(RESPONSES, json={"input": "What is 1 + 2?", "max_output_tokens": 300, **body})
    assert resp.status == 200, await resp.text()
    return Response.model_validate(await resp.json())


async def _streamed(client: TestClient, body: dict[str, Any]) -> list[Any]:
    resp = await client.post(RESPONSES, json={"input": "What is 1 + 2?", "max_output_tokens": 300, "stream": True,
                                              **body})
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = [EVENTS.validate_python(event) for event in typed_events(await resp.text())]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    return events


def _client_view(response: Response) -> list[tuple[Any, ...]]:
    """What a client reads of a response's output, without the ids made up per answer."""
    view = []
    for item in response.output:
        if item.type == "message":
            view.append(("message", [part.text for part in item.content]))
        else:
            view.append(("function_call", item.name, item.arguments))
    return view


@pytest.mark.parametrize("spells, body, view, status", [
    ("3", {}, [("message", ["3"])], "completed"),
    ("3", {"tools": [ADD, NOW], "tool_choice": "none"}, [("message", ["3"])], "completed"),
    ("Sure." + CALL, {"tools": [ADD, NOW]}, [("message", ["Sure."]), ("function_call", "add", '{"a": 1, "b": 2}')],
     "completed"),
    (CALL + CALL, {"tools": [ADD], "parallel_tool_calls": False}, [("function_call", "add", '{"a": 1, "b": 2}')],
     "completed"),
    ('{"a": 1, "b": 2}', {"tools": [ADD, NOW], "tool_choice": {"type": "function", "name": "add"}},
     [("function_call", "add", '{"a": 1, "b": 2}')], "completed"),
    ('[{"name": "now", "parameters": {}}]', {"tools": [ADD, NOW], "tool_choice": "required"},
     [("function_call", "now", "{}")], "completed"),
    ("abcdef", {"max_output_tokens": 3}, [("message", ["abc"])], "incomplete"),
])
async def test_whole_and_streamed_answers_show_the_same_output(client: TestClient, engine: FakeEngine, spells: str,
                                                               body: dict, view: list, status: str) -> None:
    engine.spells = spells
    whole = await _whole(client, body)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.status == status
    assert _client_view(whole) == view
    assert (whole.incomplete_details is not None) == (status == "incomplete")
    prompt = len(engine.requests[-1].prompt_token_ids)
    output_tokens = min(len(spells), body.get("max_output_tokens", 300))
    assert whole.usage.model_dump(exclude_none=True) == {
        "input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": prompt}, "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + output_tokens}

    events = await _streamed(client, body)
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    completed = events[-1]
    assert completed.type == "response.completed" and completed.response.status == status
    assert _client_view(completed.response) == view
    assert completed.response.usage == whole.usage
    # the items the stream sent are those of the completed response, with the same ids, at their output_index
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item for e in done] == completed.response.output
    assert [e.output_index for e in done] == list(range(len(done)))
    texts = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert texts == "".join(part for kind, *rest in view if kind == "message" for part in rest[0])
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == "".join(rest[1] for kind, *rest in view if kind == "function_call")


async def test_a_stream_opens_and_closes_each_item_in_order(client: TestClient, engine: FakeEngine) -> None:
    engine.spells = "Sure." + CALL
    kinds = [e.type.removeprefix("response.") for e in await _streamed(client, {"tools": [ADD]})]
    assert kinds == ["created", "in_progress", "output_item.added", "content_part.added",
                     *["output_text.delta"] * len("Sure."), "output_text.done", "content_part.done",
                     "output_item.done", "output_item.added", "function_call_arguments.delta",
                     "function_call_arguments.done", "output_item.done", "completed"]


async def test_the_response_repeats_the_request(client: TestClient, engine: FakeEngine) -> None:
    body = {"instructions": "Be brief.", "metadata": {"k": "v"}, "temperature": 0.5, "top_p": 0.9, "user": "u",
            "tools": [ADD], "tool_choice": "required", "parallel_tool_calls": False, "truncation": "auto",
            "text": {"format": {"type": "text"}}, "store": True}
    engine.spells = '[{"name": "add", "parameters": {"a": 1, "b": 2}}]'
    whole = await _whole(client, body)
    assert (whole.instructions, whole.metadata, whole.temperature, whole.top_p, whole.user) == (
        "Be brief.", {"k": "v"}, 0.5, 0.9, "u")
    assert whole.tool_choice == "required" and whole.parallel_tool_calls is False
    assert [tool.name for tool in whole.tools] == ["add"] and whole.truncation == "auto"
    assert whole.max_output_tokens == 300 and whole.text.format.type == "text"
    bare = await _whole(client, {})
    assert bare.tool_choice == "none" and bare.tools == [] and bare.instructions is None


async def test_input_items_become_the_conversation_chat_would_render(client: TestClient, engine: FakeEngine) -> None:
    """instructions, a user turn, an assistant's text and two calls, their outputs: the prompt of the chat body that
    says the same."""
    engine.spells = "3"
    await _whole(client, {"instructions": "Add.", "tools": [ADD], "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "1 + 2"}, {"type": "input_text", "text": "?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Calling."}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1, "b": 2}'},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 2, "b": 1}'},
        {"type": "reasoning", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "3"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "3"}]},
    ]})
    responses_prompt = engine.requests[-1].prompt_token_ids
    calls = [{"id": c, "type": "function", "function": {"name": "add", "arguments": a}}
             for c, a in (("c1", '{"a": 1, "b": 2}'), ("c2", '{"a": 2, "b": 1}'))]
    resp = await client.post("/v1/chat/completions", json={"max_tokens": 300, "tools": [
        {"type": "function", "function": {"name": "add", "description": None, "parameters": PARAMS}}], "messages": [
        {"role": "system", "content": "Add."}, {"role": "user", "content": "1 + 2\n?"},
        {"role": "assistant", "content": "Calling.", "tool_calls": calls},
        {"role": "tool", "content": "3", "tool_call_id": "c1"}, {"role": "tool", "content": "3", "tool_call_id": "c2"},
    ]})
    assert resp.status == 200, await resp.text()
    assert engine.requests[-1].prompt_token_ids == responses_prompt


@pytest.mark.parametrize("status", ["incomplete", "in_progress"])
async def test_an_unfinished_final_message_is_continued(client: TestClient, engine: FakeEngine, status: str) -> None:
    """As vLLM: the model continues the last message (chat's continue_final_message), no new assistant turn."""
    await _whole(client, {"input": [{"role": "user", "content": "hi"}, {
        "type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hal"}], "status": status}]})
    assert bytes(engine.requests[-1].prompt_token_ids) == b"<user>hi\n<assistant>Hal"
    await _whole(client, {"input": [{"role": "user", "content": "hi"}, {
        "type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hal"}]}]})
    assert bytes(engine.requests[-1].prompt_token_ids) == b"<user>hi\n<assistant>Hal\n<assistant>"


async def test_the_output_may_run_to_the_end_of_the_context(client: TestClient, engine: FakeEngine) -> None:
    """Without max_output_tokens, as vLLM's Responses: the rest of the context."""
    engine.spells = "3"
    whole = await _whole(client, {"max_output_tokens": None})
    prompt = len(engine.requests[-1].prompt_token_ids)
    assert engine.requests[-1].sampling.max_tokens == 512 - prompt == whole.max_output_tokens


async def test_text_format_and_logprobs_reach_the_engine(client: TestClient, engine: FakeEngine) -> None:
    engine.spells = '{"a": 1}'
    whole = await _whole(client, {"text": {"format": {"type": "json_schema", "name": "sum", "schema": PARAMS}},
                                  "include": ["message.output_text.logprobs"], "top_logprobs": 2})
    constraint = engine.requests[-1].sampling.constraint
    assert constraint is not None and constraint.kind is ConstraintKind.JSON
    assert json.loads(constraint.spec) == PARAMS
    logprobs = whole.output[0].content[0].logprobs
    assert [lp.token for lp in logprobs] == list('{"a": 1}') and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    events = await _streamed(client, {"include": ["message.output_text.logprobs"]})
    assert all(len(e.logprobs) == 1 for e in events if e.type == "response.output_text.delta")


async def test_auto_tools_without_the_parser_flags_answer_text(engine: FakeEngine) -> None:
    """A node without --enable-auto-tool-choice shows the tools to the model and reads its answer as text, as vLLM's
    Responses do (its chat refuses such a body)."""
    client = await _client(engine)
    try:
        engine.spells = CALL
        whole = await _whole(client, {"tools": [ADD]})
        assert _client_view(whole) == [("message", [CALL])] and whole.tool_choice == "auto"
        assert bytes(t for t in engine.requests[-1].prompt_token_ids if t < 256).startswith(b"<tools>add")
    finally:
        await client.close()


async def test_a_failure_after_the_stream_started_is_an_error_event(client: TestClient, engine: FakeEngine) -> None:
    engine.fail_at_output = 2
    events = await _streamed(client, {})
    assert events[-1].type == "error" and events[-1].code == "kv_transfer_error"
    assert "lease expired" in events[-1].message
    assert [e.type for e in events].count("response.output_text.delta") == 2


@pytest.mark.parametrize("body, status, param", [
    ({"input": None}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0].role"),
    ({"input": [{"role": []}]}, 400, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input[0].content"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "add"}]}, 400, "input[0].arguments"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "reasoning", "summary": [], "status": "incomplete"}]},
     400, "input[1]"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"max_output_tokens": 5000}, 400, "max_output_tokens"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0]"),
    ({"tools": [{"type": "function"}]}, 400, "tools[0].function.name"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "name": "sub"}}, 400, "tool_choice"),
    ({"text": {"format": {"type": "xml"}}}, 400, "text.format"),
    ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}}, 400, "structured_outputs"),
    ({"include": "message.output_text.logprobs"}, 400, "include"),
    ({"truncation": "middle"}, 400, "truncation"),
    ({"background": True}, 400, "background"),
    ({"prompt": {"id": "p"}}, 400, "prompt"),
    ({"metadata": "x"}, 400, "metadata"),
    ({"service_tier": "gold"}, 400, "service_tier"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"model": "another"}, 404, "model"),
    ({"previous_response_id": "resp_1"}, 404, None),
])
async def test_bad_bodies_are_refused_naming_the_field(client: TestClient, engine: FakeEngine, body: dict,
                                                       status: int, param: str | None) -> None:
    resp = await client.post(RESPONSES, json={"input": "hi", **body})
    assert resp.status == status, await resp.text()
    error = (await resp.json())["error"]
    assert error["param"] == param and error["message"]
    assert engine.requests == []


async def test_no_response_is_stored(client: TestClient) -> None:
    for method, path in (("GET", "/v1/responses/resp_1"), ("POST", "/v1/responses/resp_1/cancel")):
        resp = await client.request(method, path)
        assert resp.status == 404
        assert "resp_1" in (await resp.json())["error"]["message"]
