"""A Responses API body (`POST /v1/responses`, OpenAI's newer endpoint, which vLLM serves) as the chat completions body
it asks for: the node serves it through the chat path, the proxy tokenizes it as the node does.

- `instructions` become a first system message; `input` is a string (one user message) or a list of items:
  messages (`{"role", "content"}`, `"type": "message"` optional; content a string or `input_text` / `output_text`
  parts), `function_call` items (an assistant's calls: each joins the assistant message before it, as vLLM joins
  them) and `function_call_output` items (tool messages). `reasoning` items are dropped: no chat template here
  renders reasoning. Anything else (images, files, item references, hosted tools' calls) is refused by name. A last
  message whose `status` is `in_progress` or `incomplete` is continued, not answered (chat's
  `continue_final_message`, as vLLM does).
- `tools` are flat (`{"type": "function", "name", "description"?, "parameters"?, "strict"?}`) and become chat
  tools (`description` and `parameters` null when not given: what vLLM hands its chat template); `tool_choice`
  `{"type": "function", "name"}` becomes chat's named choice.
- `max_output_tokens` -> `max_completion_tokens`; `text.format` (`json_schema` with its `schema` at the top level,
  `json_object`, `text`) -> `response_format`; `include: ["message.output_text.logprobs"]` with `top_logprobs` ->
  chat's logprobs; `truncation: "auto"` -> `truncate_prompt_tokens: -1`. vLLM's own fields (sampling, stop,
  `structured_outputs`, `kv_transfer_params`, `cache_salt`, `chat_template_kwargs`...) pass as they are.

Responses are not stored (vLLM does not store them either unless told to by an environment variable): `store` is
accepted and ignored as vLLM ignores it, `previous_response_id` names a response that cannot be found (404), and
`background` (which needs the store) is refused. Every refusal is an InvalidRequestError whose `param` is the
Responses field, never the chat field it became (`responses_param`).
"""

from __future__ import annotations

from typing import Any

from hybridpd.errors import InvalidRequestError, NotFoundError

RESPONSES_PATH = "/v1/responses"
OUTPUT_LOGPROBS = "message.output_text.logprobs"
INPUT_ROLES = frozenset({"system", "developer", "user", "assistant"})

# vLLM's fields that mean the same in both bodies.
_PASSED = ("model", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logit_bias", "skip_special_tokens",
           "include_stop_str_in_output", "structured_outputs", "kv_transfer_params", "cache_salt",
           "chat_template_kwargs", "parallel_tool_calls", "stream", "bad_words", "min_tokens")
# The chat fields a Responses field became: an error about one names the other.
_CHAT_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                "response_format": "text.format", "logprobs": "include", "truncate_prompt_tokens": "truncation"}


def responses_param(param: str | None) -> str | None:
    """The Responses field a chat field's error is about (`messages[2].content` -> `input`)."""
    if param is None:
        return None
    for chat, responses in _CHAT_PARAMS.items():
        if param == chat or param.startswith((f"{chat}.", f"{chat}[")):
            return responses
    return param


def _text_parts(content: Any, param: str, *, first_only: bool) -> str:
    """A message's text: a string, or its text parts joined by newlines (an assistant's first part only, as vLLM
    reads an assistant message)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise InvalidRequestError(f"{param} must be a string or a non-empty list of text parts", param)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            shown = kind if isinstance(kind, str) else type(part).__name__
            raise InvalidRequestError(f"{param} holds a part of type {shown!r:.40}: only text parts (input_text, "
                                      "output_text) are served", param)
        texts.append(part["text"])
    return texts[0] if first_only else "\n".join(texts)


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{param}.{key} must be a string", f"{param}.{key}")
    return value


def _call(item: dict[str, Any], param: str) -> dict[str, Any]:
    return {"id": _string(item, "call_id", param), "type": "function",
            "function": {"name": _string(item, "name", param), "arguments": _string(item, "arguments", param)}}


def _tool_output(item: dict[str, Any], param: str) -> dict[str, Any]:
    output = item.get("output")
    text = output if isinstance(output, str) else _text_parts(output, f"{param}.output", first_only=False)
    return {"role": "tool", "content": text, "tool_call_id": _string(item, "call_id", param)}


def _ends_unfinished(input_value: Any) -> bool:
    """Whether the input's last item is unfinished (`in_progress` or `incomplete`): the model continues it instead of
    starting a new turn, as vLLM continues it (its `continue_final_message`)."""
    return (isinstance(input_value, list) and bool(input_value) and isinstance(input_value[-1], dict)
            and input_value[-1].get("status") in ("in_progress", "incomplete"))


def _messages(input_value: Any, instructions: str | None) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(input_value, str):
        return [*messages, {"role": "user", "content": input_value}]
    if not isinstance(input_value, list) or not input_value:
        raise InvalidRequestError("input must be a string or a non-empty list of items", "input")
    for index, item in enumerate(input_value):
        param = f"input[{index}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{param} must be an object", param)
        kind = item.get("type", "message")
        previous = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in INPUT_ROLES:
                raise InvalidRequestError(f"{param}.role must be one of {sorted(INPUT_ROLES)}", f"{param}.role")
            text = _text_parts(item.get("content"), f"{param}.content", first_only=role == "assistant")
            if previous is not None and role == "assistant" and previous["content"] is None:
                previous["content"] = text
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call = _call(item, param)
            if previous is not None:
                previous.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_tool_output(item, param))
        elif kind == "reasoning":
            if item.get("encrypted_content"):
                raise InvalidRequestError("encrypted reasoning content is not supported", param)
            if index == len(input_value) - 1 and _ends_unfinished(input_value):
                raise InvalidRequestError("continuing an unfinished reasoning item is not served: no chat template "
                                          "here renders reasoning", param)
        else:
            raise InvalidRequestError(f"Unsupported input item type: {kind!s:.40}", param)
    return messages


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise InvalidRequestError("tools must be a list of function tools", "tools")
    tools = []
    for index, tool in enumerate(value):
        param = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise InvalidRequestError(f"{param} is a {kind!s:.40} tool: only function tools "
                                      '({"type": "function", "name", "parameters"}) are served', param)
        function = {"name": tool.get("name"), "description": tool.get("description"),
                    "parameters": tool.get("parameters"), **({"strict": tool["strict"]} if "strict" in tool else {})}
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
        return {"type": "function", "function": {"name": name}}
    if value is None or value in ("none", "auto", "required"):
        return value
    raise InvalidRequestError('tool_choice must be "none", "auto", "required" or {"type": "function", "name"}',
                              "tool_choice")


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise InvalidRequestError("text must be an object", "text")
    form = text.get("format")
    if form is None:
        return None
    if not isinstance(form, dict) or form.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequestError('text.format.type must be "text", "json_object" or "json_schema"', "text.format")
    if form["type"] == "text":
        return None
    if form["type"] == "json_object":
        return {"type": "json_object"}
    schema = {key: form[key] for key in ("name", "schema", "strict", "description") if key in form}
    return {"type": "json_schema", "json_schema": schema}


def _logprobs(body: dict[str, Any]) -> dict[str, Any]:
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or not all(isinstance(x, str) for x in include)):
        raise InvalidRequestError("include must be a list of strings", "include")
    if include and OUTPUT_LOGPROBS in include:
        top = body.get("top_logprobs")
        return {"logprobs": True, **({"top_logprobs": top} if top else {})}
    return {}


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completions body a Responses body asks for (see the module's text); raises InvalidRequestError for
    what is not served, NotFoundError for a `previous_response_id`."""
    if body.get("background"):
        raise InvalidRequestError("background responses need a response store, which this server does not keep",
                                  "background")
    if body.get("prompt") is not None:
        raise InvalidRequestError("prompt template is not supported", "prompt")
    if body.get("previous_response_id") is not None:
        raise NotFoundError(f"Response with id '{body['previous_response_id']!s:.80}' not found.")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequestError("instructions must be a string", "instructions")
    if body.get("text") is not None and body.get("structured_outputs") is not None:
        raise InvalidRequestError("Cannot specify both structured_outputs and text.format", "structured_outputs")
    truncation = body.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise InvalidRequestError('truncation must be "auto" or "disabled"', "truncation")
    chat: dict[str, Any] = {key: body[key] for key in _PASSED if key in body}
    chat["messages"] = _messages(body.get("input"), instructions)
    if _ends_unfinished(body.get("input")):
        chat |= {"add_generation_prompt": False, "continue_final_message": True}
    if "max_output_tokens" in body:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"))
    if tools is not None:
        chat["tools"] = tools
        if choice is not None:
            chat["tool_choice"] = choice
    elif choice not in (None, "none", "auto"):
        message = ("Tool choice 'required' must be specified with 'tools' parameter." if choice == "required"
                   else "Tool choice 'function' not found in 'tools' parameter.")
        raise InvalidRequestError(message, "tool_choice")
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    if truncation == "auto":
        chat["truncate_prompt_tokens"] = -1
    return {**chat, **_logprobs(body)}
