"""Tool calls read from an answer's text: whole and streamed in any pieces, the same calls and content; the
`granite4` format against a brute-force reference; the finish reasons OpenAI gives."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpd.server.tool_calls import (
    TOOL_CALL_END, TOOL_CALL_START, finish_reason, read_whole, tool_call_reader,
)
from hybridpd.server.tool_fields import ToolChoice, ToolUse

TOOLS = ({"type": "function", "function": {"name": "get_weather"}},
         {"type": "function", "function": {"name": "add"}})
AUTO = ToolUse(TOOLS, ToolChoice.AUTO, parser="granite4")
AUTO_ONE = ToolUse(TOOLS, ToolChoice.AUTO, parallel=False, parser="granite4")
REQUIRED = ToolUse(TOOLS, ToolChoice.REQUIRED)
NAMED = ToolUse(TOOLS, ToolChoice.NAMED, function="add")


def _call(name: str, arguments: dict | str) -> str:
    return TOOL_CALL_START + json.dumps({"name": name, "arguments": arguments}) + TOOL_CALL_END


def _calls(message) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.tool_calls]


@pytest.mark.parametrize("use, text, content, calls", [
    # auto: text around calls is content; whitespace alone beside calls is none
    (AUTO, "It is sunny.", "It is sunny.", []),
    (AUTO, _call("get_weather", {"city": "Zürich"}), None, [("get_weather", '{"city": "Zürich"}')]),
    (AUTO, "Let me look." + _call("add", {"a": 1}) + "\n" + _call("add", '{"a": 2}'), "Let me look.\n",
     [("add", '{"a": 1}'), ("add", '{"a": 2}')]),
    (AUTO, "\n" + _call("add", {}) + "\n", None, [("add", "{}")]),
    # a call that does not read as one stays in the content as written; so does one that never ends
    (AUTO, "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    (AUTO, '<tool_call>{"name": "add"}</tool_call>', '<tool_call>{"name": "add"}</tool_call>', []),
    (AUTO, 'x<tool_call>{"name": "add", "arguments": {', 'x<tool_call>{"name": "add", "arguments": {', []),
    (AUTO, "a <tool", "a <tool", []),
    (AUTO, "</tool_call> <tool_call", "</tool_call> <tool_call", []),
    # parallel_tool_calls false keeps the first call
    (AUTO_ONE, _call("add", {"a": 1}) + _call("add", {"a": 2}), None, [("add", '{"a": 1}')]),
    # required: the constrained list; cut short, the calls that ended
    (REQUIRED, '[{"name": "add", "parameters": {"a": 1}}, {"name": "get_weather", "parameters": {}}]', "",
     [("add", '{"a": 1}'), ("get_weather", "{}")]),
    (REQUIRED, '[{"name": "add", "parameters": {"a": 1}}, {"na', "", [("add", '{"a": 1}')]),
    (REQUIRED, '[{"name": "add", "parameters": {"s": "}]\\"{"}}]', "", [("add", '{"s": "}]\\"{"}')]),
    (REQUIRED, '[\n {"name": "add",\t"parameters": {"a": [1, {"b": 2}]}} ]', "", [("add", '{"a": [1, {"b": 2}]}')]),
    (REQUIRED, '[{"name": "add"}, {"name": "", "parameters": {}}, "x"]', "", []),
    (ToolUse(TOOLS, ToolChoice.REQUIRED, parallel=False),
     '[{"name": "add", "parameters": {}}, {"name": "get_weather", "parameters": {}}]', "", [("add", "{}")]),
    # named: the output is the arguments
    (NAMED, '{"a": 1, "b": 2}', "", [("add", '{"a": 1, "b": 2}')]),
    (NAMED, "", "", []),
])
def test_whole_answers(use, text, content, calls):
    message = read_whole(use, text)
    assert message.content == content
    assert _calls(message) == calls
    assert message.called == bool(calls)
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in message.tool_calls)
    assert len({c["id"] for c in message.tool_calls}) == len(calls)


def test_tool_choice_none_reads_nothing():
    assert read_whole(ToolUse(TOOLS, ToolChoice.NONE), _call("add", {})) is None


def _streamed(use: ToolUse, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """The content and calls a client puts together from the deltas of a stream of these pieces."""
    reader = tool_call_reader(use)
    deltas = [reader.feed(piece) for piece in pieces] + [reader.finish()]
    calls: dict[int, list[str]] = {}
    for piece in (p for d in deltas for p in d.calls):
        if piece.id is not None:
            assert piece.index not in calls
            calls[piece.index] = [piece.name, ""]
        calls[piece.index][1] += piece.arguments
    return "".join(d.content for d in deltas), [tuple(calls[i]) for i in sorted(calls)]


def _reference_granite4(text: str) -> tuple[str, list[tuple[str, str]]]:
    """Brute force: scan left to right for complete `<tool_call>...</tool_call>` spans; a span whose body is a call
    is a call, any other text is content."""
    content, calls, at = "", [], 0
    while True:
        start = text.find(TOOL_CALL_START, at)
        end = text.find(TOOL_CALL_END, start + len(TOOL_CALL_START)) if start >= 0 else -1
        if end < 0:
            return content + text[at:], calls
        body = text[start + len(TOOL_CALL_START):end]
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        if isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"] and isinstance(
                call.get("arguments"), (dict, str)):
            arguments = call["arguments"]
            calls.append((call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
            content += text[at:start]
        else:
            content += text[at:end + len(TOOL_CALL_END)]
        at = end + len(TOOL_CALL_END)


_ATOMS = st.sampled_from(["a", " ", "\n", "<", "tool", "_call", ">", "</", "<tool_call>", "</tool_call>",
                          '{"name": "add", "arguments": {"a": 1}}', '{"name": "f", "arguments": "x"}', "{", "}",
                          _call("add", {"a": 1}), _call("get_weather", "{}"), "<tool_call>[]</tool_call>"])


@settings(max_examples=300, deadline=None)
@given(st.lists(_ATOMS, max_size=14), st.lists(st.integers(0, 200), max_size=8))
def test_granite4_streamed_in_any_pieces_matches_the_reference(atoms, cuts):
    text = "".join(atoms)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    expected_content, expected_calls = _reference_granite4(text)
    content, calls = _streamed(AUTO, pieces)
    assert (content, calls) == (expected_content, expected_calls)
    whole = read_whole(AUTO, text)
    assert _calls(whole) == expected_calls
    assert whole.content == (None if expected_calls and not expected_content.strip() else expected_content)


@pytest.mark.parametrize("use", [NAMED, REQUIRED])
@pytest.mark.parametrize("cut", [1, 3, 7])
def test_constrained_answers_streamed_show_the_whole_answers_calls(use, cut):
    text = '{"a": 1, "b": [2, 3]}' if use is NAMED else '[{"name": "add", "parameters": {"a": 1}}]'
    content, calls = _streamed(use, [text[i:i + cut] for i in range(0, len(text), cut)])
    assert content == ""
    assert calls == _calls(read_whole(use, text))


def test_named_call_streams_its_arguments_as_they_come():
    reader = tool_call_reader(NAMED)
    first, second = reader.feed('{"a"'), reader.feed(": 1}")
    assert first.calls[0].delta() == {"index": 0, "id": first.calls[0].id, "type": "function",
                                      "function": {"name": "add", "arguments": '{"a"'}}
    assert second.calls[0].delta() == {"index": 0, "function": {"arguments": ": 1}"}}


@pytest.mark.parametrize("use, called, reason, expected", [
    (None, False, "stop", "stop"),
    (AUTO, True, "stop", "tool_calls"),
    (AUTO, False, "stop", "stop"),
    (AUTO, True, "length", "length"),
    (REQUIRED, False, "stop", "tool_calls"),
    (REQUIRED, True, "length", "length"),
    (NAMED, True, "stop", "stop"),
    (ToolUse(TOOLS, ToolChoice.NONE), False, "stop", "stop"),
    (AUTO, False, None, None),
])
def test_finish_reason(use, called, reason, expected):
    assert finish_reason(use, called, reason) == expected


_LIST_ATOMS = st.sampled_from(['{"name": "add", "parameters": {"a": 1}}', '{"name": "get_weather", "parameters": {}}',
                               '{"name": "add", "parameters": {"s": "}]\\\\\\"{"}}', ", ", "\n", " "])


@settings(max_examples=200, deadline=None)
@given(st.lists(_LIST_ATOMS, max_size=8), st.integers(0, 400), st.lists(st.integers(0, 400), max_size=8))
def test_required_calls_streamed_in_any_pieces_are_each_sent_once_it_ends(atoms, cut, cuts):
    """A "required" list cut anywhere, streamed in any pieces: the calls of the elements that ended, each sent whole
    (one piece with its id, name and arguments), the same as the whole answer reads; a brute-force reference reads the
    ended elements with json."""
    text = ("[" + "".join(atoms) + "]")[:cut]
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    reader = tool_call_reader(REQUIRED)
    sent = [p for piece in pieces for p in reader.feed(piece).calls] + list(reader.finish().calls)
    assert all(p.id is not None for p in sent)
    expected, end = [], 1
    for atom in atoms:
        end += len(atom)
        if atom.startswith("{") and end <= len(text):
            item = json.loads(atom)
            expected.append((item["name"], json.dumps(item["parameters"])))
    assert [(p.name, p.arguments) for p in sent] == expected
    assert _calls(read_whole(REQUIRED, text)) == expected
