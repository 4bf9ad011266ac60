"""A chat body's tools and tool choice as vLLM reads them: the tool use, the constraint it puts on the output (vLLM's
schemas, compiled), or a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from hybridpd.engine.output_constraint import ConstraintKind
from hybridpd.errors import InvalidRequestError
from hybridpd.server.fields import Fields
from hybridpd.server.tool_fields import ToolChoice, ToolParsing, template_tool_calls, tool_use

PARAMS = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
ADD = {"type": "function", "function": {"name": "add", "description": "adds", "parameters": PARAMS}}
NOW = {"type": "function", "function": {"name": "now"}}
AUTO = ToolParsing(auto=True, parser="granite4")


def _use(body, parsing=ToolParsing()):
    return tool_use(Fields(body), parsing)


@pytest.mark.parametrize("body, parsing, choice, function", [
    ({}, ToolParsing(), None, None),
    ({"tool_choice": "none"}, ToolParsing(), None, None),
    ({"tools": [ADD], "tool_choice": "none"}, ToolParsing(), ToolChoice.NONE, None),
    ({"tools": [ADD]}, AUTO, ToolChoice.AUTO, None),
    ({"tools": [ADD], "tool_choice": "auto"}, AUTO, ToolChoice.AUTO, None),
    ({"tools": [ADD, NOW], "tool_choice": "required"}, ToolParsing(), ToolChoice.REQUIRED, None),
    ({"tools": [ADD, NOW], "tool_choice": {"type": "function", "function": {"name": "now"}}}, ToolParsing(),
     ToolChoice.NAMED, "now"),
    ({"tools": [ADD], "tool_choice": {"function": {"name": "add"}}}, AUTO, ToolChoice.NAMED, "add"),
])
def test_accepted(body, parsing, choice, function):
    use = _use(body, parsing)
    if choice is None:
        assert use is None
        return
    assert use.choice is choice and use.function == function
    assert use.tools == tuple(body["tools"])
    assert use.parser == ("granite4" if choice is ToolChoice.AUTO else None)


def test_named_choice_constrains_to_the_tools_parameters():
    constraint = _use({"tools": [ADD, NOW], "tool_choice": {"type": "function", "function": {"name": "add"}}}
                      ).constraint()
    assert constraint.kind is ConstraintKind.JSON and json.loads(constraint.spec) == PARAMS
    assert constraint.field == "tools"
    no_parameters = _use({"tools": [NOW], "tool_choice": {"function": {"name": "now"}}}).constraint()
    assert json.loads(no_parameters.spec) == {"type": "object", "properties": {}}


@pytest.mark.parametrize("parallel, most", [(True, None), (False, 1)])
def test_required_choice_constrains_to_a_list_of_calls(parallel, most):
    definitions = {"Point": {"type": "object", "properties": {"x": {"type": "number"}}}}
    drawn = {"type": "function", "function": {"name": "draw", "parameters": {
        "type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}}, "$defs": definitions}}}
    use = _use({"tools": [ADD, NOW, drawn], "tool_choice": "required", "parallel_tool_calls": parallel})
    schema = json.loads(use.constraint().spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema.get("maxItems") == most
    assert schema["$defs"] == definitions
    options = schema["items"]["anyOf"]
    assert [o["properties"]["name"]["enum"] for o in options] == [["add"], ["now"], ["draw"]]
    assert options[0]["properties"]["parameters"] == PARAMS
    assert options[1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert "$defs" not in options[2]["properties"]["parameters"]
    assert all(o["required"] == ["name", "parameters"] for o in options)


def test_auto_and_none_do_not_constrain():
    assert _use({"tools": [ADD]}, AUTO).constraint() is None
    assert _use({"tools": [ADD], "tool_choice": "none"}).constraint() is None


@pytest.mark.parametrize("body, parsing, param", [
    ({"tools": [ADD]}, ToolParsing(), "tool_choice"),              # auto needs the flags
    ({"tools": [ADD], "tool_choice": "auto"}, ToolParsing(), "tool_choice"),
    ({"tool_choice": "required"}, AUTO, "tool_choice"),            # a choice without tools
    ({"tool_choice": {"function": {"name": "add"}}}, AUTO, "tool_choice"),
    ({"tools": []}, AUTO, "tools"),
    ({"tools": {"add": ADD}}, AUTO, "tools"),
    ({"tools": ["add"]}, AUTO, "tools[0]"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, AUTO, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, AUTO, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, AUTO, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": 3}}]}, AUTO, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, AUTO,
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]}, AUTO,
     "tools[0].function.description"),
    ({"tools": [ADD, ADD]}, AUTO, "tools"),
    ({"tools": [ADD], "tool_choice": "any"}, AUTO, "tool_choice"),
    ({"tools": [ADD], "tool_choice": 1}, AUTO, "tool_choice"),
    ({"tools": [ADD], "tool_choice": {"type": "function"}}, AUTO, "tool_choice.function"),
    ({"tools": [ADD], "tool_choice": {"function": {"name": ""}}}, AUTO, "tool_choice.function.name"),
    ({"tools": [ADD], "tool_choice": {"function": {"name": "sub"}}}, AUTO, "tool_choice"),
    ({"tools": [ADD], "tool_choice": {"type": "custom", "function": {"name": "add"}}}, AUTO, "tool_choice.type"),
    ({"tools": [ADD], "tool_choice": "required", "parallel_tool_calls": "no"}, AUTO, "parallel_tool_calls"),
    # a parameters schema that does not compile is refused before the engine sees it
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}],
      "tool_choice": "required"}, AUTO, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$defs": {"P": {"type": "string"}}}}},
                {"type": "function", "function": {"name": "g", "parameters": {"$defs": {"P": {"type": "number"}}}}}],
      "tool_choice": "required"}, AUTO, "tools"),
])
def test_refused(body, parsing, param):
    with pytest.raises(InvalidRequestError) as caught:
        _use(body, parsing)
    assert caught.value.param == param


@pytest.mark.parametrize("auto, parser", [(True, None), (False, "hermes")])
def test_node_flags_refused(auto, parser):
    with pytest.raises(ValueError, match="tool-call-parser"):
        ToolParsing(auto, parser)


@pytest.mark.parametrize("arguments, expected", [
    ('{"a": 1}', {"a": 1}),
    ({"a": 1}, {"a": 1}),
    ("", {}),
    (None, {}),
    ("{not json", {}),     # a malformed call in the history must not fail every later turn
    ("[1, 2]", {}),
])
def test_history_calls_reach_the_template_with_object_arguments(arguments, expected):
    calls = template_tool_calls([{"id": "c1", "type": "function", "function": {"name": "add", "arguments": arguments}}],
                                "messages[1].tool_calls")
    assert calls == [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": expected}}]


@pytest.mark.parametrize("raw, param", [
    ({"id": "c1"}, "messages[1].tool_calls"),
    (["c1"], "messages[1].tool_calls[0]"),
    ([{"type": "code", "function": {}}], "messages[1].tool_calls[0]"),
    ([{"function": {"name": 1}}], "messages[1].tool_calls[0].function.name"),
    ([{"function": {"arguments": "{}"}}], "messages[1].tool_calls[0].function.name"),
])
def test_history_calls_refused(raw, param):
    with pytest.raises(InvalidRequestError) as caught:
        template_tool_calls(raw, "messages[1].tool_calls")
    assert caught.value.param == param
