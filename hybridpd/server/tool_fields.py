"""A chat body's `tools`, `tool_choice` and `parallel_tool_calls` -> `ToolUse`, checked as vLLM checks them.

- `tools`: a non-empty list of `{"type": "function", "function": {"name", "description"?, "parameters"?}}`, handed to
  the chat template as they came (the template shows them to the model), whatever the tool choice.
- `tool_choice`: `"none"` (the answer is text), `"auto"` (the default with tools: the model may call tools in its
  own format, which the node's `--tool-call-parser` reads; needs `--enable-auto-tool-choice`, as vLLM), `"required"`
  (the output is constrained to a JSON list of `{"name", "parameters"}` calls of the given tools, vLLM's schema) or
  `{"type": "function", "function": {"name"}}` (the output is constrained to that tool's parameters). A choice
  without tools is refused.
- `parallel_tool_calls: false`: one call at most (the "required" schema's `maxItems`; auto keeps the first call).

The two constrained choices need no parser (the constraint fixes the format); vLLM asks for `--tool-call-parser`
for them too. Here they are served with or without one.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from hybridpd.engine.output_constraint import ConstraintKind, OutputConstraint
from hybridpd.errors import InvalidRequestError
from hybridpd.server.fields import Fields

TOOL_CALL_PARSERS = ("granite4",)   # `<tool_call>{"name": ..., "arguments": ...}</tool_call>`: Granite 4.0's format
_NAMED_USAGE = 'send {"type": "function", "function": {"name": "my_function"}}'


class ToolChoice(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolParsing:
    """The node's tool-call flags (vLLM's `--enable-auto-tool-choice`, `--tool-call-parser`)."""

    auto: bool = False
    parser: str | None = None

    def __post_init__(self) -> None:
        if self.parser is not None and self.parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.parser!r}")
        if self.auto and self.parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")


@dataclass(frozen=True)
class ToolUse:
    tools: tuple[dict[str, Any], ...]   # as the body gave them (the chat template's `tools`)
    choice: ToolChoice
    function: str | None = None          # the named tool
    parallel: bool = True                # several calls in one answer
    parser: str | None = None            # the node's parser (AUTO only)

    @property
    def constrained(self) -> bool:
        return self.choice in (ToolChoice.REQUIRED, ToolChoice.NAMED)

    def constraint(self) -> OutputConstraint | None:
        """The output's constraint: the named tool's parameters, or a list of calls (vLLM's schemas)."""
        if self.choice is ToolChoice.NAMED:
            return _json(_parameters(self._tool(self.function)))
        if self.choice is not ToolChoice.REQUIRED:
            return None
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                            "parameters": _parameters(t)},
             "required": ["name", "parameters"]} for t in self.tools]}}
        if not self.parallel:
            schema["maxItems"] = 1
        definitions = _definitions(self.tools)
        if definitions:
            schema["$defs"] = definitions
        return _json(schema)

    def _tool(self, name: str | None) -> dict[str, Any]:
        return next(t for t in self.tools if t["function"]["name"] == name)


def _json(schema: dict[str, Any]) -> OutputConstraint:
    return OutputConstraint(ConstraintKind.JSON, json.dumps(schema), field="tools")


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema without its `$defs` (the "required" schema holds them once); none or empty: any
    object, as vLLM constrains a tool that takes no parameters."""
    parameters = {k: v for k, v in (tool["function"].get("parameters") or {}).items() if k != "$defs"}
    return parameters or {"type": "object", "properties": {}}


def _definitions(tools: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for tool in tools:
        for name, schema in ((tool["function"].get("parameters") or {}).get("$defs") or {}).items():
            if merged.setdefault(name, schema) != schema:
                raise InvalidRequestError(f"tools define $defs.{name} twice, differently", "tools")
    return merged


def _tool(raw: Any, index: int) -> dict[str, Any]:
    param = f"tools[{index}]"
    if not isinstance(raw, dict):
        raise InvalidRequestError(f"{param} must be an object", param)
    if raw.get("type", "function") != "function":
        raise InvalidRequestError(f"{param}.type must be \"function\"", f"{param}.type")
    function = Fields(raw, f"{param}.").optional_object("function")
    if function is None:
        raise InvalidRequestError(f"{param}.function is required", f"{param}.function")
    name = function.optional_str("name")
    if not name:
        raise function.fail("name", "must be a non-empty string")
    function.optional_str("description")
    parameters = function.optional_object("parameters")
    if parameters is not None and parameters.raw("$defs") is not None:
        parameters.optional_object("$defs")
    return raw


def _named(choice: dict[str, Any], names: set[str]) -> str:
    function = choice.get("function")
    if not isinstance(function, dict):
        raise InvalidRequestError(f"tool_choice.function must be an object: {_NAMED_USAGE}", "tool_choice.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"tool_choice.function.name must be a non-empty string: {_NAMED_USAGE}",
                                  "tool_choice.function.name")
    if name not in names:
        raise InvalidRequestError(f"the tool named in tool_choice ({name!r:.60}) is not one of tools", "tool_choice")
    return name


def tools_field(raw_tools: Any) -> tuple[dict[str, Any], ...] | None:
    """A body's `tools` (None when it gives none), checked: what the chat template is handed."""
    if raw_tools is None:
        return None
    if not isinstance(raw_tools, list) or not raw_tools:
        raise InvalidRequestError("tools must be a non-empty list (omit it for none)", "tools")
    tools = tuple(_tool(raw, index) for index, raw in enumerate(raw_tools))
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools must have distinct names", "tools")
    return tools


def tool_use(f: Fields, parsing: ToolParsing) -> ToolUse | None:
    """The body's tool use; None when it gives no tools (and no tool choice but "none")."""
    tools, choice = tools_field(f.raw("tools")), f.raw("tool_choice")
    if tools is None:
        if choice is not None and choice != "none":
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")
        return None
    names = [t["function"]["name"] for t in tools]
    parallel = f.bool("parallel_tool_calls", True)
    if isinstance(choice, dict):
        if choice.get("type", "function") != "function":
            raise InvalidRequestError(f"tool_choice.type must be \"function\": {_NAMED_USAGE}", "tool_choice.type")
        use = ToolUse(tools, ToolChoice.NAMED, _named(choice, set(names)), parallel)
    elif choice in (None, "auto"):
        if not parsing.auto:
            raise InvalidRequestError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                      'to be set (send tool_choice "none", "required" or a named tool)', "tool_choice")
        use = ToolUse(tools, ToolChoice.AUTO, parallel=parallel, parser=parsing.parser)
    elif choice in ("none", "required"):
        use = ToolUse(tools, ToolChoice(choice), parallel=parallel)
    else:
        raise InvalidRequestError(f'tool_choice must be "none", "auto", "required" or a named tool: {_NAMED_USAGE}',
                                  "tool_choice")
    constraint = use.constraint()
    if constraint is not None:
        constraint.check()
    return use


def template_tool_calls(raw: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` as chat templates read them (transformers' convention, as vLLM hands them
    over): each call's `arguments` an object. Arguments that are not a JSON object's text become `{}`, as vLLM makes
    them (a malformed call in the history must not fail every later turn of the conversation)."""
    if not isinstance(raw, list):
        raise InvalidRequestError(f"{param} must be a list", param)
    calls = []
    for index, call in enumerate(raw):
        if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(
                call.get("function"), dict):
            raise InvalidRequestError(f"{param}[{index}] must be {{\"type\": \"function\", \"function\": {{...}}}}",
                                      f"{param}[{index}]")
        function = Fields(call["function"], f"{param}[{index}].function.")
        if not function.optional_str("name"):
            raise function.fail("name", "must be a non-empty string")
        arguments = function.raw("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments else {}
            except ValueError:
                arguments = {}
        calls.append({**call, "function": {**call["function"],
                                           "arguments": arguments if isinstance(arguments, dict) else {}}})
    return calls
