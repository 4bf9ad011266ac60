"""A chat answer's tool calls, read from the output text as it arrives: one reader per choice, fed each output's new
text and finished once. A streamed answer sends what each feed returns; a whole answer feeds its text once, so both
show the same calls and content.

- named tool choice: the output is the tool's arguments (the constraint made it so): one call, its arguments
  streamed as they come (the first piece carries the call's id and name, as vLLM streams it);
- "required": the output is a JSON list of `{"name", "parameters"}` (the constraint's): each element one call, its
  parameters as the arguments' JSON text, sent whole as soon as the element ends (vLLM streams the parameters as
  they come); a list cut short keeps the calls that ended;
- auto with the `granite4` parser: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` anywhere in the text;
  the text around calls is content, streamed as it comes but for what may be the start of a `<tool_call>` tag; each
  call is sent whole once its end tag arrives (as vLLM's `granite4` parser streams). A call whose JSON does not read
  as one, or that never ends, stays in the content as the model wrote it.

With `parallel_tool_calls: false` the calls after the first are dropped (vLLM's rule).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from hybridpd.server.tool_fields import ToolChoice, ToolUse

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class CallPiece:
    """A piece of one call: its first carries the id and name, the rest more of its arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def delta(self) -> dict[str, Any]:
        """The piece as a stream's `delta.tool_calls` entry."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolDelta:
    content: str = ""
    calls: tuple[CallPiece, ...] = ()


class ToolCallReader(Protocol):
    called: bool   # a call was read (auto: the answer's finish_reason is then "tool_calls")

    def feed(self, text: str) -> ToolDelta: ...

    def finish(self) -> ToolDelta: ...


class NamedCall:
    def __init__(self, name: str) -> None:
        self._name = name
        self.called = False

    def feed(self, text: str) -> ToolDelta:
        if not text:
            return ToolDelta()
        first = not self.called
        self.called = True
        if first:
            return ToolDelta(calls=(CallPiece(0, text, tool_call_id(), self._name),))
        return ToolDelta(calls=(CallPiece(0, text),))

    def finish(self) -> ToolDelta:
        return ToolDelta()


class RequiredCalls:
    """The constrained list `[{"name", "parameters"}, ...]`: each element read as a call once it ends (its closing
    brace back at the list's level), so a stream sends each call whole as soon as it is written, and a list cut short
    (max_tokens, a stop) keeps the calls that ended."""

    def __init__(self, parallel: bool) -> None:
        self._parallel = parallel
        self._element: list[str] = []   # the element being written (from its opening brace)
        self._depth = 0                 # 1 inside the list, 2 inside an element, more inside its values
        self._in_string = self._escaped = False
        self._count = 0
        self.called = False

    def feed(self, text: str) -> ToolDelta:
        calls = []
        for char in text:
            if self._depth >= 2 or (self._depth == 1 and char in "{[" and not self._in_string):
                self._element.append(char)
            if self._in_string:
                self._escaped, self._in_string = (False, True) if self._escaped else (char == "\\", char != '"')
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 1:
                    calls += self._ended("".join(self._element))
                    self._element = []
        return ToolDelta(calls=tuple(calls))

    def _ended(self, element: str) -> list[CallPiece]:
        try:
            item = json.loads(element)
        except ValueError:
            return []
        if not _is_call(item, "parameters") or (self._count and not self._parallel):
            return []
        self._count += 1
        self.called = True
        return [CallPiece(self._count - 1, _arguments(item["parameters"]), tool_call_id(), item["name"])]

    def finish(self) -> ToolDelta:
        return ToolDelta()


class TaggedCalls:
    """`<tool_call>{"name", "arguments"}</tool_call>` calls among text (the `granite4` parser)."""

    def __init__(self, parallel: bool) -> None:
        self._parallel = parallel
        self._held = ""         # text not yet shown: a possible start tag, or a call not yet ended
        self._in_call = False
        self._count = 0
        self.called = False

    def feed(self, text: str) -> ToolDelta:
        self._held += text
        content: list[str] = []
        calls: list[CallPiece] = []
        while True:
            if not self._in_call:
                start = self._held.find(TOOL_CALL_START)
                if start < 0:
                    keep = _partial_tag(self._held, TOOL_CALL_START)
                    content.append(self._held[:len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep:]
                    break
                content.append(self._held[:start])
                self._held, self._in_call = self._held[start + len(TOOL_CALL_START):], True
            end = self._held.find(TOOL_CALL_END)
            if end < 0:
                break
            body, self._held, self._in_call = self._held[:end], self._held[end + len(TOOL_CALL_END):], False
            call = _tagged_call(body)
            if call is None:
                content.append(TOOL_CALL_START + body + TOOL_CALL_END)
                continue
            if self._parallel or self._count == 0:
                calls.append(CallPiece(self._count, call[1], tool_call_id(), call[0]))
            self._count += 1
            self.called = True
        return ToolDelta("".join(content), tuple(calls))

    def finish(self) -> ToolDelta:
        """What is still held goes out as content: a tag's start that never became one, a call that never ended."""
        held = (TOOL_CALL_START if self._in_call else "") + self._held
        self._held, self._in_call = "", False
        return ToolDelta(held)


def _partial_tag(text: str, tag: str) -> int:
    """How many of `text`'s last characters are the start of `tag` (they may become it)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _is_call(item: Any, arguments_key: str) -> bool:
    return (isinstance(item, dict) and isinstance(item.get("name"), str) and item["name"] != ""
            and isinstance(item.get(arguments_key), (dict, str)))


def _arguments(value: dict[str, Any] | str) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _tagged_call(body: str) -> tuple[str, str] | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not _is_call(call, "arguments"):
        return None
    return call["name"], _arguments(call["arguments"])


def tool_call_reader(use: ToolUse) -> ToolCallReader | None:
    """The reader of an answer under `use`; None when its output is plain text (tool choice "none")."""
    if use.choice is ToolChoice.NAMED:
        assert use.function is not None
        return NamedCall(use.function)
    if use.choice is ToolChoice.REQUIRED:
        return RequiredCalls(use.parallel)
    if use.choice is ToolChoice.AUTO:
        return TaggedCalls(use.parallel)
    return None


@dataclass(frozen=True)
class ToolMessage:
    """A whole answer's message fields under tool use."""

    content: str | None
    tool_calls: tuple[dict[str, Any], ...]

    @property
    def called(self) -> bool:
        return bool(self.tool_calls)


def read_output(reader: ToolCallReader | None, text: str, finished: bool) -> ToolDelta:
    """What one output's new text shows: fed to the reader, and the reader finished when the output is the last;
    without a reader (no calls are read) the text is content."""
    if reader is None:
        return ToolDelta(text)
    read = reader.feed(text)
    if not finished:
        return read
    last = reader.finish()
    return ToolDelta(read.content + last.content, read.calls + last.calls)


def read_whole(use: ToolUse, text: str) -> ToolMessage | None:
    """A whole answer's text read as a stream of one piece; None under tool choice "none"."""
    reader = tool_call_reader(use)
    if reader is None:
        return None
    read = read_output(reader, text, finished=True)
    content = read.content
    calls: dict[int, dict[str, Any]] = {}
    for piece in read.calls:
        if piece.id is not None:
            calls[piece.index] = {"id": piece.id, "type": "function",
                                  "function": {"name": piece.name, "arguments": piece.arguments}}
        else:
            calls[piece.index]["function"]["arguments"] += piece.arguments
    if use.constrained:
        shown: str | None = ""          # vLLM's: the calls are the answer, its content empty
    else:
        shown = None if calls and not content.strip() else content
    return ToolMessage(shown, tuple(calls[i] for i in sorted(calls)))


def finish_reason(use: ToolUse | None, called: bool, reason: str | None) -> str | None:
    """OpenAI's: "tool_calls" where an auto answer called a tool or a "required" one stopped; a named call keeps
    its own."""
    if use is None or reason != "stop":
        return reason
    if (use.choice is ToolChoice.AUTO and called) or use.choice is ToolChoice.REQUIRED:
        return "tool_calls"
    return reason
