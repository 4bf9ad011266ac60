"""An Anthropic Messages body -> the chat request it asks for (hybridpd/message_bodies.py), served under a `msg_` id;
a count_tokens body -> the number of tokens of the prompt it describes. Errors name the Messages field."""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import replace
from typing import Any

from hybridpd.engine.tokenizer import Tokenizer
from hybridpd.errors import InvalidRequestError, renamed
from hybridpd.message_bodies import chat_body, count_tokens_body, messages_param
from hybridpd.server.chat_templating import ChatTemplating
from hybridpd.server.engine_client import EngineClient
from hybridpd.server.protocol import ParsedRequest, parse_chat_request, parse_tokenize_request
from hybridpd.server.tool_fields import ToolParsing


def _renamed(exc: InvalidRequestError) -> InvalidRequestError:
    """A chat field's error about the Messages field it came from."""
    return renamed(exc, messages_param(exc.param))


def needs_system_first(tokenizer: Tokenizer) -> bool:
    """Whether the chat template refuses a system message after the first turn (Qwen's templates do): then a
    Messages body's inline system messages are joined into the first, as vLLM probes and joins them."""
    probe = [{"role": "system", "content": "t"}, {"role": "user", "content": "t"}] * 2
    try:
        tokenizer.apply_chat_template(probe, False)
    except InvalidRequestError:
        return True
    return False


def parse_messages_request(body: dict[str, Any], engine: EngineClient, model_names: Collection[str],
                           tool_parsing: ToolParsing = ToolParsing(), templating: ChatTemplating = ChatTemplating(),
                           *, merge_inline_system: bool = False) -> ParsedRequest:
    chat = chat_body(body, merge_inline_system=merge_inline_system)
    try:
        parsed = parse_chat_request(chat, engine, model_names, tool_parsing, templating)
    except InvalidRequestError as exc:
        raise _renamed(exc) from None
    return replace(parsed, engine_request=replace(parsed.engine_request, request_id=f"msg_{uuid.uuid4().hex}"))


def count_tokens(body: dict[str, Any], engine: EngineClient, model_names: Collection[str],
                 templating: ChatTemplating = ChatTemplating(), *, merge_inline_system: bool = False) -> int:
    """The tokens of the prompt a Messages body with this conversation, tools and template inputs would have (the
    chat template's generation prompt included)."""
    try:
        tokenize = count_tokens_body(body, merge_inline_system=merge_inline_system)
        return len(parse_tokenize_request(tokenize, engine, model_names, templating).tokens)
    except InvalidRequestError as exc:
        raise _renamed(exc) from None
