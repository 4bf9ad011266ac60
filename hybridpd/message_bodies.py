"""An Anthropic Messages body (`POST /v1/messages`, which vLLM serves beside OpenAI's endpoints, and which Claude Code
and the `anthropic` client speak) as the chat completions body it asks for: the node serves it through the chat
path, the proxy tokenizes it as the node does. The conversion is vLLM's:

- `system` (a string, or text blocks joined) becomes a first system message; a system-role message in `messages`
  stays where it is, unless the chat template needs the system prompt first (it refuses a later one, as Qwen's
  templates do): then, as vLLM does, every system text is joined into the first message (`merge_inline_system`).
  A text that starts with `x-anthropic-billing-header` (Claude Code's per-request attribution line) is left out,
  as vLLM leaves it out: it would differ in every request and defeat the prefix cache.
- A message's `content` is a string or a list of blocks: `text`; `tool_use` (an assistant's call: `input` becomes
  the call's JSON arguments); `tool_result` (in a user's message: a tool message before the user's own text, its
  content a string or text blocks joined by newlines; in an assistant's: text `Tool result: ...`); `thinking`,
  `redacted_thinking` and `tool_reference` blocks are dropped (no chat template here renders reasoning). Images,
  documents and anything else are refused by name.
- `tools` (`{"name", "description"?, "input_schema"}`; `input_schema` without a `type` is an object) become function
  tools with `tool_choice` `auto` unless one is given: `{"type": "auto" | "any" | "none" | "tool", "name"?,
  "disable_parallel_tool_use"?}` -> `auto` / `required` / `none` / the named function, `parallel_tool_calls` false
  when parallel use is disabled. Anthropic's server tools (a `type` other than `custom`) are refused by name.
- `max_tokens` (required, at least 1) -> `max_completion_tokens`; `stop_sequences` -> `stop`; `temperature`,
  `top_p`, `top_k` as they are; `output_config.format` (`json_schema` with its `schema`) -> `response_format`;
  a stream asks for the usage in every chunk (the events carry it). `thinking` is checked as vLLM checks it
  (`budget_tokens` at least 1,024 and below `max_tokens`) and changes nothing: no model here thinks;
  `output_config.effort` and `metadata` likewise. vLLM's own fields `kv_transfer_params`, `cache_salt` and
  `chat_template_kwargs` pass as they are.

Every refusal is an InvalidRequestError whose `param` is the Messages field (`messages_param`), never the chat field
it became. Errors on these paths are Anthropic's shape (`anthropic_error`).
"""

from __future__ import annotations

import json
from typing import Any

from hybridpd.errors import InvalidRequestError

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
BILLING_HEADER = "x-anthropic-billing-header"
MESSAGE_ROLES = frozenset({"user", "assistant", "system"})
MIN_THINKING_BUDGET = 1024

# vLLM's fields that mean the same in both bodies (`model` and `chat_template_kwargs` go with the prompt's fields).
_PASSED = ("temperature", "top_p", "top_k", "kv_transfer_params", "cache_salt")
# The chat fields a Messages field became: an error about one names the other.
_CHAT_PARAMS = {"messages": "messages", "max_completion_tokens": "max_tokens", "max_tokens": "max_tokens",
                "stop": "stop_sequences", "response_format": "output_config.format", "tools": "tools",
                "tool_choice": "tool_choice", "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}
# Anthropic's error types by HTTP status (what its API and clients use).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """An error body in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def messages_param(param: str | None) -> str | None:
    """The Messages field a chat field's error is about (`messages[3].content` -> `messages`: the chat's messages are
    not the body's one for one)."""
    if param is None:
        return None
    for chat, field in _CHAT_PARAMS.items():
        if param == chat or param.startswith((f"{chat}.", f"{chat}[")):
            return field
    return param


def _fail(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param} {message}", param)


def _text(block: dict[str, Any], param: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _fail("must hold a string `text`", f"{param}.text")
    return text


def _kept(text: str) -> bool:
    return bool(text) and not text.startswith(BILLING_HEADER)


def _system_text(value: Any, param: str) -> str:
    """A system prompt's text: a string, or its text blocks joined (other blocks are not text and are skipped)."""
    if isinstance(value, str):
        return value if _kept(value) else ""
    if not isinstance(value, list):
        raise _fail("must be a string or a list of text blocks", param)
    texts = []
    for index, block in enumerate(value):
        if not isinstance(block, dict):
            raise _fail("must be an object", f"{param}[{index}]")
        if block.get("type") in ("tool_addition", "tool_removal"):
            raise _fail(f"is a {block['type']} block: changing the tools within a conversation is not served",
                        f"{param}[{index}]")
        if block.get("type") == "text":
            text = _text(block, f"{param}[{index}]")
            if _kept(text):
                texts.append(text)
    return "".join(texts)


def _tool_call(block: dict[str, Any], param: str) -> dict[str, Any]:
    name, call_id, arguments = block.get("name"), block.get("id"), block.get("input")
    if not isinstance(name, str) or not name:
        raise _fail("must name the tool (`name`)", f"{param}.name")
    if not isinstance(call_id, str):
        raise _fail("must be a string", f"{param}.id")
    if arguments is not None and not isinstance(arguments, dict):
        raise _fail("must be an object", f"{param}.input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments or {})}}


def _tool_result_text(block: dict[str, Any], param: str) -> str:
    content = block.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise _fail("must be a string or a list of text blocks", f"{param}.content")
    texts = []
    for index, item in enumerate(content):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "text":
            texts.append(_text(item, f"{param}.content[{index}]"))
        elif kind != "tool_reference":
            raise _fail(f"is a {kind!s:.40} block: a tool's result is served as text", f"{param}.content[{index}]")
    return "\n".join(texts)


def _message(raw: Any, index: int, messages: list[dict[str, Any]]) -> None:
    """Appends message `index` (and the tool messages of its tool results, first) to the chat's `messages`."""
    param = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise _fail("must be an object", param)
    role, content = raw.get("role"), raw.get("content")
    if not isinstance(role, str) or role not in MESSAGE_ROLES:
        raise _fail(f"must be one of {sorted(MESSAGE_ROLES)}", f"{param}.role")
    if role == "system":
        text = _system_text(content, f"{param}.content")
        if text:
            messages.append({"role": "system", "content": text})
        return
    if isinstance(content, str):
        messages.append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise _fail("must be a string or a list of content blocks", f"{param}.content")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for number, block in enumerate(content):
        where = f"{param}.content[{number}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text = _text(block, where)
            if text:
                texts.append(text)
        elif kind == "tool_use":
            calls.append(_tool_call(block, where))
        elif kind == "tool_result":
            text = _tool_result_text(block, where)
            if role == "user":
                call_id = block.get("tool_use_id")
                messages.append({"role": "tool", "tool_call_id": call_id if isinstance(call_id, str) else "",
                                 "content": text})
            else:
                texts.append(f"Tool result: {text}")
        elif kind in ("thinking", "redacted_thinking", "tool_reference"):
            continue
        elif kind in ("tool_addition", "tool_removal"):
            raise _fail(f'is a {kind} block: only allowed in messages with role "system"', where)
        else:
            raise _fail(f"is a {kind!s:.40} block: only text, tool_use, tool_result and thinking blocks are served "
                        "(the model reads text)", where)
    if role == "user" and not texts:   # tool results alone: their tool messages are the turn
        return
    message: dict[str, Any] = {"role": role, "content": "\n".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    messages.append(message)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise _fail("must be a non-empty list of messages", "messages")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _system_text(system, "system")
        if text:
            messages.append({"role": "system", "content": text})
    for index, raw in enumerate(value):
        _message(raw, index, messages)
    return messages


def _system_first(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with every system message's text joined into one first system message, as vLLM joins them
    for a template that needs the system prompt first."""
    texts = [message["content"] for message in messages if message["role"] == "system"]
    rest = [message for message in messages if message["role"] != "system"]
    return [{"role": "system", "content": "".join(texts)}, *rest] if texts else rest


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise _fail("must be a list of tools", "tools")
    tools = []
    for index, tool in enumerate(value):
        param = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise _fail("must be an object", param)
        if tool.get("type", "custom") != "custom":
            raise _fail(f"is a {tool['type']!s:.40} tool: only custom tools (`name`, `input_schema`) are served",
                        param)
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise _fail("must be a non-empty string", f"{param}.name")
        if not isinstance(schema, dict):
            raise _fail("must be an object (a JSON schema)", f"{param}.input_schema")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise _fail("must be a string", f"{param}.description")
        function = {"name": name, "description": description, "parameters": {"type": "object", **schema}}
        if isinstance(tool.get("strict"), bool):
            function["strict"] = tool["strict"]
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: Any, chat: dict[str, Any]) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or value.get("type") not in ("auto", "any", "none", "tool"):
        raise _fail('must be {"type": "auto" | "any" | "none" | "tool"}', "tool_choice")
    disabled = value.get("disable_parallel_tool_use")
    if disabled is not None and not isinstance(disabled, bool):
        raise _fail("must be a boolean", "tool_choice.disable_parallel_tool_use")
    chat["parallel_tool_calls"] = not disabled
    kind = value["type"]
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise _fail("is required when type is 'tool'", "tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        chat["tool_choice"] = {"any": "required"}.get(kind, kind)


def _response_format(config: Any) -> dict[str, Any] | None:
    if config is None:
        return None
    if not isinstance(config, dict):
        raise _fail("must be an object", "output_config")
    effort = config.get("effort")
    if effort is not None and effort not in ("low", "medium", "high", "xhigh", "max"):
        raise _fail('must be "low", "medium", "high", "xhigh" or "max"', "output_config.effort")
    form = config.get("format")
    if form is None:
        return None
    if not isinstance(form, dict) or form.get("type", "json_schema") != "json_schema":
        raise _fail('must be {"type": "json_schema", "schema": {...}}', "output_config.format")
    schema = form.get("schema")
    if schema is None:
        return None
    if not isinstance(schema, dict):
        raise _fail("must be an object (a JSON schema)", "output_config.format.schema")
    return {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}


def _check_thinking(body: dict[str, Any], max_tokens: int | None) -> None:
    """`thinking`, checked as vLLM checks it (a P/D prefill call, which asks for one token, is not)."""
    thinking = body.get("thinking")
    if thinking is None:
        return
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise _fail('must be {"type": "enabled" | "disabled" | "adaptive"}', "thinking")
    if thinking["type"] != "enabled":
        return
    budget = thinking.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < MIN_THINKING_BUDGET:
        raise _fail(f"must be an integer of at least {MIN_THINKING_BUDGET}", "thinking.budget_tokens")
    params = body.get("kv_transfer_params")
    if isinstance(params, dict) and params.get("do_remote_decode"):
        return
    if max_tokens is not None and budget >= max_tokens:
        raise _fail("must be less than max_tokens", "thinking.budget_tokens")


def _max_tokens(body: dict[str, Any]) -> int:
    value = body.get("max_tokens")
    if value is None:
        raise _fail("is required", "max_tokens")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _fail("must be a positive integer", "max_tokens")
    return value


def _stop(value: Any) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _fail("must be a list of strings", "stop_sequences")
    return value


def _model(body: dict[str, Any]) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _fail("is required (a non-empty string)", "model")


def _prompt_fields(body: dict[str, Any], merge_inline_system: bool) -> dict[str, Any]:
    """What a Messages body and a count_tokens body share: the conversation, the tools and the template's inputs."""
    _model(body)
    chat: dict[str, Any] = {key: body[key] for key in ("model", "chat_template_kwargs") if key in body}
    messages = _messages(body)
    chat["messages"] = _system_first(messages) if merge_inline_system else messages
    tools = _tools(body.get("tools"))
    _tool_choice(body.get("tool_choice"), chat)
    if tools is not None:
        chat["tools"] = tools
        chat.setdefault("tool_choice", "auto")
    elif chat.get("tool_choice") in ("auto", "none"):   # nothing to choose from: the answer is text
        del chat["tool_choice"], chat["parallel_tool_calls"]
    response_format = _response_format(body.get("output_config"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


def chat_body(body: dict[str, Any], *, merge_inline_system: bool = False) -> dict[str, Any]:
    """The chat completions body a Messages body asks for (see the module's text); raises InvalidRequestError for
    what is not served."""
    max_tokens = _max_tokens(body)
    _check_thinking(body, max_tokens)
    chat = {key: body[key] for key in _PASSED if key in body} | _prompt_fields(body, merge_inline_system)
    chat["max_completion_tokens"] = max_tokens
    stop = _stop(body.get("stop_sequences"))
    if stop is not None:
        chat["stop"] = stop
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _fail("must be a boolean", "stream")
    if stream:
        chat |= {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    return chat


def count_tokens_body(body: dict[str, Any], *, merge_inline_system: bool = False) -> dict[str, Any]:
    """The `/tokenize` body (chat messages) whose tokens a count_tokens body counts: the prompt a Messages body with
    the same conversation, tools and template inputs would have."""
    _check_thinking(body, None)
    return _prompt_fields(body, merge_inline_system)
