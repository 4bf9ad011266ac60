"""A Responses API body -> the chat request it asks for (hybridpd/response_bodies.py), and what its Response object
repeats of it (vLLM's `ResponsesResponse.from_request`).

Where vLLM's Responses differ from its chat, so do ours: tools with the default `"auto"` choice on a node without
`--enable-auto-tool-choice` are shown to the model and its answer is read as text (chat refuses that body). As chat,
without `max_output_tokens` the output may run to the end of the context (the checkpoint's `max_new_tokens` when it
sets one). Errors name the Responses field (`input`, not `messages[0]`).
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import Any

from hybridpd.errors import InvalidRequestError, renamed
from hybridpd.response_bodies import chat_body, responses_param
from hybridpd.server.chat_templating import ChatTemplating
from hybridpd.server.engine_client import EngineClient
from hybridpd.server.fields import Fields
from hybridpd.server.protocol import ParsedRequest, parse_chat_request
from hybridpd.server.tool_fields import ToolParsing

SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")


@dataclass(frozen=True)
class ResponsesRequest:
    parsed: ParsedRequest           # served as a chat request, under the response's id
    repeated: dict[str, Any]        # the body's fields the Response object repeats

    @property
    def id(self) -> str:
        return self.parsed.request_id


def _renamed(exc: InvalidRequestError) -> InvalidRequestError:
    """A chat field's error about the Responses field it came from."""
    return renamed(exc, responses_param(exc.param))


def _checked(f: Fields) -> None:
    """The fields only the Response object repeats, checked for their types (a bad one is refused, never echoed)."""
    f.optional_object("metadata")
    f.optional_object("reasoning")
    f.optional_str("user")
    f.bool("store", True)
    f.optional_int("max_tool_calls", minimum=1)
    tier = f.optional_str("service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise f.fail("service_tier", f"must be one of {', '.join(SERVICE_TIERS)}")


def parse_responses_request(body: dict[str, Any], engine: EngineClient, model_names: Collection[str],
                            tool_parsing: ToolParsing = ToolParsing(),
                            templating: ChatTemplating = ChatTemplating()) -> ResponsesRequest:
    f = Fields(body)
    _checked(f)
    chat = chat_body(body)
    if chat.get("tools") and chat.get("tool_choice", "auto") == "auto" and not tool_parsing.auto:
        chat["tool_choice"] = "none"
    try:
        parsed = parse_chat_request(chat, engine, model_names, tool_parsing, templating)
    except InvalidRequestError as exc:
        raise _renamed(exc) from None
    parsed = replace(parsed, engine_request=replace(parsed.engine_request, request_id=f"resp_{uuid.uuid4().hex}"))
    sampling = parsed.engine_request.sampling
    tools = body.get("tools") or []
    choice = body.get("tool_choice")
    if choice is None or (not tools and choice == "auto"):
        choice = "auto" if tools else "none"
    repeated = {
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata"),
        "parallel_tool_calls": f.bool("parallel_tool_calls", True),
        "temperature": sampling.temperature,
        "tool_choice": choice,
        "tools": tools,
        "top_p": sampling.top_p,
        "background": False,
        "max_output_tokens": sampling.max_tokens,
        "max_tool_calls": body.get("max_tool_calls"),
        "previous_response_id": None,
        "prompt": None,
        "reasoning": body.get("reasoning"),
        "service_tier": body.get("service_tier") or "auto",
        "text": body.get("text"),
        "top_logprobs": sampling.logprobs,
        "truncation": body.get("truncation") or "disabled",
        "user": body.get("user"),
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
    }
    return ResponsesRequest(parsed, repeated)
