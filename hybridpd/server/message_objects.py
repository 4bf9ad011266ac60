"""Anthropic Messages answers shaped like vLLM's (and Anthropic's): the `message` object, and a stream's events.

A whole answer is one `message`: its `content` a `text` block (when there is text) and a `tool_use` block per call
(`input` the call's arguments as an object; a call whose arguments are not a JSON object stays in the text as the
model wrote it), or one empty text block for an empty answer (Anthropic's shape: clients read `content[0]`).
`stop_reason`: `max_tokens` when the output hit its length, `tool_use` when it called a tool, `stop_sequence` (with
the sequence) when a stop string ended it, else `end_turn`. The usage counts prompt tokens found in the prefix cache
as `cache_read_input_tokens`, the rest as `input_tokens` (vLLM's, with its prompt tokens' details on).

A stream is `event: <type>` / `data: <json>` pairs, no `[DONE]`:
  message_start (the message, no content yet, the prompt's usage)
  -> per block: content_block_start -> content_block_delta (`text_delta` / `input_json_delta`) ... ->
     content_block_stop
  -> message_delta (stop_reason, stop_sequence, the usage) -> message_stop
Text that arrives while a tool_use block is open waits for it to close (a block's deltas come together), as vLLM
holds it. A failure after the status went out is an `error` event, and the stream ends.
"""

from __future__ import annotations

import json
from typing import Any

from hybridpd.engine.request import FinishReason, RequestOutput
from hybridpd.message_bodies import anthropic_error
from hybridpd.server.errors import HTTPError
from hybridpd.server.protocol import ParsedRequest
from hybridpd.server.responses import FinalOutput
from hybridpd.server.tool_calls import CallPiece, read_output, read_whole, tool_call_reader


def message_usage(output: RequestOutput | FinalOutput, *, output_tokens: int | None = None) -> dict[str, Any]:
    return {"input_tokens": output.num_prompt_tokens - output.num_cached_tokens,
            "output_tokens": output.num_output_tokens if output_tokens is None else output_tokens,
            "cache_read_input_tokens": output.num_cached_tokens}


def stop_fields(reason: FinishReason | None, matched: str | int | None, *, called: bool,
                complete: bool) -> dict[str, str | None]:
    """`stop_reason` and `stop_sequence`, by vLLM's rule: the length first; then tool_use when the calls are complete
    (a stop string that cut one short must not run it); then a matched stop string (a stop token id is not a
    sequence); then tool_use for any call; else end_turn."""
    if reason is FinishReason.LENGTH:
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if complete:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if isinstance(matched, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": matched}
    return {"stop_reason": "tool_use" if called else "end_turn", "stop_sequence": None}


def _input(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as the object a tool_use block's `input` is; None when they are not one."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _head(parsed: ParsedRequest, model: str) -> dict[str, Any]:
    return {"id": parsed.response_id, "type": "message", "role": "assistant", "model": model}


def whole_message(parsed: ParsedRequest, final: FinalOutput, model: str) -> dict[str, Any]:
    text, calls = final.text, ()
    read = read_whole(parsed.tool_use, final.text) if parsed.tool_use is not None else None
    if read is not None:
        text, calls = read.content or "", read.tool_calls
    content: list[dict[str, Any]] = []
    uses = []
    for call in calls:
        arguments = _input(call["function"]["arguments"])
        if arguments is None:
            text += call["function"]["arguments"]
        else:
            uses.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments})
    if text or not uses:
        content.append({"type": "text", "text": text})
    body = {**_head(parsed, model), "content": content + uses,
            **stop_fields(final.finish_reason, final.stop_reason, called=bool(uses), complete=bool(uses)),
            "usage": message_usage(final)}
    if final.kv_transfer_params is not None:
        body["kv_transfer_params"] = final.kv_transfer_params
    return body


class MessageEvents:
    """Turns each output of one request into its events; keeps which block is open."""

    def __init__(self, parsed: ParsedRequest, model: str, first: RequestOutput) -> None:
        self._parsed = parsed
        self._first = first             # its usage opens the stream
        self._model = model
        self._reader = tool_call_reader(parsed.tool_use) if parsed.tool_use is not None else None
        self._index = 0                 # the next block's index
        self._open: str | None = None   # the open block's type
        self._held = ""                 # text that came while a tool_use block was open
        self._arguments = ""            # the latest call's arguments so far

    def start(self) -> list[dict[str, Any]]:
        message = {**_head(self._parsed, self._model), "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": message_usage(self._first, output_tokens=0)}
        return [{"type": "message_start", "message": message}]

    def events(self, output: RequestOutput) -> list[dict[str, Any]]:
        """The events of one output; the last output's end with message_delta and message_stop."""
        read = read_output(self._reader, output.new_text, output.finished)
        content, calls = read.content, read.calls
        events = self._text(content) if content else []
        for piece in calls:
            events += self._call(piece)
        if output.finished:
            events += self._close()
            called = self._reader is not None and self._reader.called
            stop = stop_fields(output.finish_reason, output.stop_reason, called=called,
                               complete=called and _input(self._arguments) is not None)
            events += [{"type": "message_delta", "delta": stop, "usage": message_usage(output)},
                       {"type": "message_stop"}]
        return events

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self._open = block["type"]
        return [{"type": "content_block_start", "index": self._index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._index, "delta": delta}

    def _text(self, text: str) -> list[dict[str, Any]]:
        if self._open == "tool_use":
            self._held += text
            return []
        events = [] if self._open == "text" else self._start({"type": "text", "text": ""})
        return events + [self._delta({"type": "text_delta", "text": text})]

    def _call(self, piece: CallPiece) -> list[dict[str, Any]]:
        events = []
        if piece.id is not None:   # a call's first piece: a new block
            events += self._close()
            self._arguments = ""
            events += self._start({"type": "tool_use", "id": piece.id, "name": piece.name or "", "input": {}})
        self._arguments += piece.arguments
        if piece.arguments:
            events.append(self._delta({"type": "input_json_delta", "partial_json": piece.arguments}))
        return events

    def _close(self) -> list[dict[str, Any]]:
        """Closes the open block; text held while a tool_use block was open follows as a block of its own."""
        if self._open is None:
            return []
        events = [{"type": "content_block_stop", "index": self._index}]
        self._open, self._index = None, self._index + 1
        held, self._held = self._held, ""
        if held:
            events += self._text(held) + self._close()
        return events

    def error(self, error: HTTPError) -> dict[str, Any]:
        return anthropic_error(error.status, error.message)
