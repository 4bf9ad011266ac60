"""Responses API answers shaped like vLLM's (and OpenAI's): the `response` object, and a stream's typed events.

A whole answer is one `response` object: its `output` a `message` item (one `output_text` part) and a
`function_call` item per tool call, its `status` `completed`, or `incomplete` (`incomplete_details.reason`
`max_output_tokens`) when the output hit its length.

A stream is `event: <type>` / `data: <json>` pairs, each event numbered (`sequence_number`), no `[DONE]`:
  response.created -> response.in_progress
  -> per output item: output_item.added [-> content_part.added -> output_text.delta ... -> output_text.done
     -> content_part.done] or [-> function_call_arguments.delta ... -> function_call_arguments.done]
     -> output_item.done
  -> response.completed (the whole object, its items those the stream sent, with their ids)
A failure after the status went out is an `error` event, and the stream ends.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from hybridpd.engine.request import FinishReason, RequestOutput
from hybridpd.engine.tokenizer import Tokenizer
from hybridpd.server.errors import HTTPError
from hybridpd.server.logprobs import chat_logprobs, token_names
from hybridpd.server.response_request import ResponsesRequest
from hybridpd.server.responses import FinalOutput
from hybridpd.server.tool_calls import CallPiece, read_output, read_whole, tool_call_reader


def response_usage(output: RequestOutput | FinalOutput) -> dict[str, Any]:
    """OpenAI's usage; `cache_write_tokens` the prompt tokens computed here (the prefix cache keeps their full
    blocks), not found in it."""
    computed = output.num_prompt_tokens - output.num_cached_tokens
    return {
        "input_tokens": output.num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": output.num_cached_tokens, "cache_write_tokens": computed},
        "output_tokens": output.num_output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": output.num_prompt_tokens + output.num_output_tokens,
    }


def response_object(asked: ResponsesRequest, model: str, created: int, *, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None,
                    kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": asked.id, "object": "response", "created_at": created, "model": model, "status": status,
            "incomplete_details": incomplete, "output": output, "usage": usage, **asked.repeated,
            "kv_transfer_params": kv_transfer_params}


def status_of(reason: FinishReason | None) -> str:
    return "incomplete" if reason is FinishReason.LENGTH else "completed"


def _message(item_id: str, text: str, logprobs: list[dict[str, Any]] | None, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [part] if text else []}


def _function_call(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(asked: ResponsesRequest, final: FinalOutput, tokenizer: Tokenizer) -> list[dict[str, Any]]:
    """A whole answer's items: its text as a message (left out when the answer is calls alone), then its calls."""
    parsed = asked.parsed
    logprobs = (chat_logprobs(final.logprobs, token_names(tokenizer, parsed.tokens_as_ids))["content"]
                if parsed.wants_logprobs else None)
    read = read_whole(parsed.tool_use, final.text) if parsed.tool_use is not None else None
    if read is None:
        return [_message(_item_id("msg"), final.text, logprobs, "completed")]
    items = [_message(_item_id("msg"), read.content or "", logprobs, "completed")] if read.content or not read.called \
        else []
    return items + [_function_call(_item_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"],
                                   "completed") for call in read.tool_calls]


def whole_response(asked: ResponsesRequest, final: FinalOutput, model: str, tokenizer: Tokenizer) -> dict[str, Any]:
    return response_object(asked, model, asked.parsed.created, status=status_of(final.finish_reason),
                           output=output_items(asked, final, tokenizer), usage=response_usage(final),
                           kv_transfer_params=final.kv_transfer_params)


def event_bytes(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, allow_nan=False)}\n\n".encode("utf-8")


class _OpenItem:
    """The output item the stream is writing: its text or arguments so far."""

    def __init__(self, item_id: str, index: int, call: CallPiece | None = None) -> None:
        self.id, self.index, self.call = item_id, index, call
        self.text = ""
        self.logprobs: list[dict[str, Any]] = []


class ResponseEvents:
    """Turns each output of one request into its events, numbered; remembers the items the stream has sent."""

    def __init__(self, asked: ResponsesRequest, model: str, tokenizer: Tokenizer) -> None:
        self._asked = asked
        self._model = model
        self._name = token_names(tokenizer, asked.parsed.tokens_as_ids)
        self._reader = tool_call_reader(asked.parsed.tool_use) if asked.parsed.tool_use is not None else None
        self._number = 0
        self._open: _OpenItem | None = None
        self._items: list[dict[str, Any]] = []

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._number, **fields}
        self._number += 1
        return event

    def _snapshot(self, status: str, usage: dict[str, Any] | None = None,
                  kv_transfer_params: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_object(self._asked, self._model, self._asked.parsed.created, status=status,
                               output=list(self._items), usage=usage, kv_transfer_params=kv_transfer_params)

    def start(self) -> list[dict[str, Any]]:
        snapshot = self._snapshot("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def events(self, output: RequestOutput) -> list[dict[str, Any]]:
        """The events of one output; the last output's end with `response.completed`."""
        read = read_output(self._reader, output.new_text, output.finished)
        content, calls = read.content, read.calls
        events: list[dict[str, Any]] = []
        if content:
            logprobs = (chat_logprobs(output.logprobs, self._name)["content"]
                        if self._asked.parsed.wants_logprobs else [])
            events += self._text(content, logprobs)
        for piece in calls:
            events += self._arguments(piece)
        if output.finished:
            events += self._close()
            events.append(self._event("response.completed", response=self._snapshot(
                status_of(output.finish_reason), response_usage(output), output.kv_transfer_params)))
        return events

    def _text(self, delta: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open.call is not None:
            events += self._close()
            self._open = _OpenItem(_item_id("msg"), len(self._items))
            events.append(self._event("response.output_item.added", output_index=self._open.index,
                                      item=_message(self._open.id, "", None, "in_progress")))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._event("response.content_part.added", output_index=self._open.index,
                                      item_id=self._open.id, content_index=0, part=part))
        self._open.text += delta
        self._open.logprobs += logprobs
        events.append(self._event("response.output_text.delta", output_index=self._open.index, item_id=self._open.id,
                                  content_index=0, delta=delta, logprobs=logprobs))
        return events

    def _arguments(self, piece: CallPiece) -> list[dict[str, Any]]:
        events = []
        if piece.id is not None:   # a call's first piece: a new item
            events += self._close()
            self._open = _OpenItem(_item_id("fc"), len(self._items), piece)
            events.append(self._event("response.output_item.added", output_index=self._open.index, item=_function_call(
                self._open.id, piece.id, piece.name or "", "", "in_progress")))
        assert self._open is not None and self._open.call is not None
        self._open.text += piece.arguments
        if piece.arguments:
            events.append(self._event("response.function_call_arguments.delta", output_index=self._open.index,
                                      item_id=self._open.id, delta=piece.arguments))
        return events

    def _close(self) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        where = {"output_index": item.index, "item_id": item.id}
        if item.call is None:
            done = _message(item.id, item.text, item.logprobs or None, "completed")
            events = [self._event("response.output_text.done", **where, content_index=0, text=item.text, logprobs=[]),
                      self._event("response.content_part.done", **where, content_index=0, part=done["content"][0])]
        else:
            done = _function_call(item.id, item.call.id or "", item.call.name or "", item.text, "completed")
            events = [self._event("response.function_call_arguments.done", **where, name=done["name"],
                                  arguments=item.text)]
        self._items.append(done)
        return events + [self._event("response.output_item.done", output_index=item.index, item=done)]

    def error(self, error: HTTPError) -> dict[str, Any]:
        return self._event("error", code=error.type, message=error.message, param=error.param)
