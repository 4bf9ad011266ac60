"""OpenAI/vLLM request bodies -> `EngineRequest`s, checked strictly: every bad input is an InvalidRequestError.

Accepted fields (unknown ones are ignored, like vLLM does; the ones vLLM acts on and this server does not are
refused by name, sampling_fields.py):
  completions: model, prompt (string | token ids | a list of those: several prompts, each its own request, answered
    together without a stream), max_tokens (16; 0 with echo: the prompt alone; at most max_model_len, and cut to
    the context the prompt leaves, as vLLM cuts it: `output_budget`), the sampling fields of
    sampling_fields.py, logprobs (int), echo (the prompt's text, and with logprobs its tokens' logprobs, before the
    output, as vLLM), prompt_logprobs (vLLM's), n (1 only), stream, stream_options.include_usage (and vLLM's
    continuous_usage_stats: the usage so far in every chunk),
    return_token_ids, kv_transfer_params, cache_salt.
  chat: messages instead of prompt, max_completion_tokens (or max_tokens; without either the rest of the context,
    as vLLM), logprobs (bool) + top_logprobs (int),
    prompt_logprobs, add_generation_prompt, continue_final_message (with add_generation_prompt false: the prompt ends
    inside the final message, which the output continues), echo (the answer starts with the final message's text
    when it is the assistant's, as vLLM), chat_template_kwargs, add_special_tokens (false),
    truncate_prompt_tokens.
A body that asks for several choices (`n` > 1, or several prompts) becomes one engine request per choice
(`parse_choices`): prompt p's sample i is choice p * n + i, its seed (when one is given) the body's + i, as vLLM
draws them; kv_transfer_params go with one choice only.
A temperature below 1e-5 is treated as greedy (0), as vLLM does, so that sampling never divides by ~0.
"""

from __future__ import annotations

import enum
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import Any

from hybridpd.completion_prompts import one_prompt, several_prompts
from hybridpd.engine.continued_chat import render_continuing
from hybridpd.engine.transfer_params import RemoteDecodeParams, parse_kv_transfer_params
from hybridpd.engine.request import EngineRequest
from hybridpd.engine.sampling_params import GREEDY_TEMPERATURE
from hybridpd.engine.tokenizer import RESERVED_TEMPLATE_VARIABLES
from hybridpd.errors import InvalidRequestError
from hybridpd.samples import MAX_N, sample_seed
from hybridpd.server.chat_templating import ChatTemplating
from hybridpd.server.engine_client import EngineClient
from hybridpd.server.errors import ModelNotFoundError
from hybridpd.server.fields import Fields
from hybridpd.server.sampling_fields import prompt_logprobs_field, refuse_unsupported, sampling_params
from hybridpd.server.tool_fields import ToolParsing, ToolUse, template_tool_calls, tool_use, tools_field
from hybridpd.stream_head import StreamHead, parse_stream_head

MAX_LOGPROBS = 20
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class Endpoint(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"


@dataclass(frozen=True)
class Echo:
    """A request's `echo`: a completion's answer starts with the prompt (its tokens' logprobs too, with logprobs); a
    chat answer's message with the final message's text when that is the assistant's (vLLM's chat `echo`, beside
    `continue_final_message`: the whole message, the part given and the part generated)."""

    text: str              # the prompt as the client gave it (a prompt of token ids decoded), or the final message
    without_output: bool   # max_tokens 0: the prompt alone (one token is generated and left out, as vLLM does)


@dataclass(frozen=True)
class Choice:
    """Where one engine request's answer goes in a body that asked for several choices (`n` > 1, several prompts)."""

    index: int          # the choice's index in the answer: prompt * n + sample
    sample: int         # which of its prompt's n samples (the first counts the prompt in the usage)
    response_id: str    # the answer's id, shared by all its choices


@dataclass(frozen=True, kw_only=True)
class ParsedRequest:
    endpoint: Endpoint
    engine_request: EngineRequest
    created: int
    stream: bool
    include_usage: bool
    return_token_ids: bool
    continuous_usage: bool = False  # every chunk carries the usage so far (vLLM's continuous_usage_stats)
    tokens_as_ids: bool = False    # logprobs name tokens `token_id:<id>` (vLLM's return_tokens_as_token_ids)
    stream_head: StreamHead | None = None  # the client has this stream's head already (hybridpd/stream_head.py)
    echo: Echo | None = None
    choice: Choice | None = None   # one of several choices of one body
    tool_use: ToolUse | None = None   # the chat body's tools and tool choice (tool_fields.py)
    role: str = "assistant"   # a chat answer's role: --response-role's, or without a generation prompt the last turn's

    @property
    def request_id(self) -> str:
        return self.engine_request.request_id

    @property
    def response_id(self) -> str:
        """The id the answer carries: the engine's request id, the stream's the client already has, or the one all
        choices of the body share."""
        if self.stream_head is not None:
            return self.stream_head.id
        return self.choice.response_id if self.choice is not None else self.engine_request.request_id

    @property
    def index(self) -> int:
        return self.choice.index if self.choice is not None else 0

    @property
    def counts_prompt(self) -> bool:
        """Whether this request's prompt tokens count in the body's usage (once per prompt, not per sample)."""
        return self.choice is None or self.choice.sample == 0

    @property
    def response_created(self) -> int:
        return self.stream_head.created if self.stream_head is not None else self.created

    @property
    def wants_logprobs(self) -> bool:
        return self.engine_request.sampling.logprobs is not None


def check_model(fields: Fields, model_names: Collection[str]) -> None:
    """A body's `model`, when it names one, must be one of the node's names (`ServerConfig.model_names`)."""
    model = fields.optional_str("model")
    if model is not None and model not in model_names:
        raise ModelNotFoundError(model, model_names)


def _token_ids(value: list[Any], vocab_size: int, param: str) -> tuple[int, ...]:
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int):
            raise InvalidRequestError(f"{param} must hold integer token ids, got {token!r:.40}", param)
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(f"token id {token} is outside the vocabulary [0, {vocab_size})", param)
    return tuple(value)


def parse_prompt(value: Any, engine: EngineClient, add_special_tokens: bool = True) -> tuple[int, ...]:
    """A string (encoded with the tokenizer's special tokens unless told not), a list of token ids, or a list holding
    exactly one of those; never empty."""
    value = one_prompt(value)
    if isinstance(value, str):
        ids = tuple(engine.tokenizer.encode(value, add_special_tokens=add_special_tokens)) if value else ()
    elif isinstance(value, list):
        if any(isinstance(item, (str, list)) for item in value):
            raise InvalidRequestError("prompt must be a string, a list of token ids, or a list of those "
                                      "(not a mix)", "prompt")
        ids = _token_ids(value, engine.vocab_size, "prompt")
    elif value is None:
        raise InvalidRequestError("prompt is required", "prompt")
    else:
        raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")
    if not ids:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    return ids


def _message_content(message: Fields, index: int) -> str:
    content = message.raw("content")
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if content is None and message.raw("role") == "assistant":
        return ""
    if not isinstance(content, list):
        raise InvalidRequestError(f"{param} must be a string or a list of text parts", param)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{param} parts must be {{\"type\": \"text\", \"text\": string}}", param)
        texts.append(part["text"])
    return "\n".join(texts)


def parse_messages(value: Any) -> list[dict[str, Any]]:
    """The conversation as the chat template reads it: each message's role and text, its `name` and `tool_call_id`
    when given, and an assistant's `tool_calls` with their arguments as objects (template_tool_calls)."""
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("messages must be a non-empty list", "messages")
    messages = []
    for index, raw in enumerate(value):
        if not isinstance(raw, dict):
            raise InvalidRequestError(f"messages[{index}] must be an object", f"messages[{index}]")
        message = Fields(raw, f"messages[{index}].")
        role = message.optional_str("role")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{index}].role must be one of {sorted(CHAT_ROLES)}", f"messages[{index}].role"
            )
        parsed: dict[str, Any] = {"role": role, "content": _message_content(message, index)}
        for key in ("name", "tool_call_id"):
            if message.optional_str(key) is not None:
                parsed[key] = message.raw(key)
        if role == "assistant" and message.raw("tool_calls"):
            parsed["tool_calls"] = template_tool_calls(message.raw("tool_calls"), f"messages[{index}].tool_calls")
        messages.append(parsed)
    return messages


def template_kwargs(f: Fields) -> tuple[dict[str, Any] | None, str | None]:
    """vLLM's `chat_template_kwargs` -> (more variables for the chat template, none of those it is rendered with;
    the template it names as `chat_template`, if any)."""
    kwargs = f.optional_object("chat_template_kwargs")
    if kwargs is None:
        return None, None
    taken = sorted(RESERVED_TEMPLATE_VARIABLES & kwargs.obj.keys())
    if taken:
        raise f.fail("chat_template_kwargs", f"may not set {', '.join(taken)}")
    variables = {key: value for key, value in kwargs.obj.items() if key != "chat_template"}
    return variables, kwargs.optional_str("chat_template")


def chat_prompt(messages: list[dict[str, Any]], engine: EngineClient, f: Fields, *,
                add_special_tokens: bool = False, tools: tuple[dict[str, Any], ...] | None = None,
                templating: ChatTemplating = ChatTemplating()) -> tuple[int, ...]:
    """The conversation rendered by the chat template (the request's own where `templating` trusts it; it holds its
    special tokens already; with the generation prompt unless `add_generation_prompt` is false, ending inside the
    final message with `continue_final_message`; `chat_template_kwargs` over the server's defaults, and `tools`
    beside) and encoded."""
    generation_prompt = f.bool("add_generation_prompt", True)
    listed = list(tools) if tools else None
    variables, named = template_kwargs(f)
    asked = f.optional_str("chat_template")
    tokenizer = templating.tokenizer_for(engine.tokenizer, asked if asked is not None else named)
    variables = templating.kwargs(variables)
    if f.bool("continue_final_message", False):
        if generation_prompt:
            raise InvalidRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True "
                                      "(add_generation_prompt is true unless the body sets it false)",
                                      "continue_final_message")
        rendered = render_continuing(tokenizer, messages, variables, listed)
    else:
        rendered = tokenizer.apply_chat_template(messages, generation_prompt, variables, listed)
    ids = tuple(engine.tokenizer.encode(rendered, add_special_tokens=add_special_tokens))
    if not ids:
        raise InvalidRequestError("the conversation renders to an empty prompt", "messages")
    return ids


def _truncated(prompt: tuple[int, ...], f: Fields, max_model_len: int) -> tuple[int, ...]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens (-1: max_model_len's worth)."""
    keep = f.optional_int("truncate_prompt_tokens", minimum=-1)
    if keep is None:
        return prompt
    if keep == 0:
        raise f.fail("truncate_prompt_tokens", "must be -1 or at least 1")
    if keep > max_model_len:
        raise f.fail("truncate_prompt_tokens", f"({keep}) is greater than max_model_len ({max_model_len}); request "
                                               "a smaller truncation size")
    return prompt[-(max_model_len if keep == -1 else keep):]


def output_budget(num_prompt: int, max_tokens: int | None, param: str, engine: EngineClient,
                  endpoint: Endpoint) -> int:
    """The output's length, by vLLM's rules: a `max_tokens` (`param`: the field it came from) beyond the context, a
    prompt beyond it, and a prompt that fills it are refused; otherwise the length asked for, or when none is asked
    16 for a completion (its field's default) and for chat the rest of the context (the checkpoint's `max_new_tokens`
    when set), is cut to what the context leaves after the prompt."""
    limit = engine.max_model_len
    if max_tokens is not None and max_tokens > limit:
        raise InvalidRequestError(f"{param}={max_tokens} cannot be greater than max_model_len={limit}. Please "
                                  "request fewer output tokens.", param)
    if num_prompt > limit:
        raise InvalidRequestError(f"This model's maximum context length is {limit} tokens. However, your prompt "
                                  f"contains {num_prompt} input tokens, which exceeds this limit even without any "
                                  "output tokens. Please reduce the length of the input prompt.", "input_tokens")
    rest = limit - num_prompt
    if rest == 0:
        raise InvalidRequestError(f"This model's maximum context length is {limit} tokens and your prompt fills it: "
                                  "no output token fits. Please reduce the length of the input prompt.", param)
    if max_tokens is None:
        max_tokens = 16 if endpoint is Endpoint.COMPLETIONS else engine.generation_defaults.max_tokens or rest
    return min(max_tokens, rest)


def _common(f: Fields, endpoint: Endpoint, prompt: tuple[int, ...], *, max_tokens: int,
            logprobs: int | None, engine: EngineClient, echo: Echo | None = None) -> ParsedRequest:
    refuse_unsupported(f.obj)
    stream = f.bool("stream", False)
    prompt_logprobs = prompt_logprobs_field(f, stream)
    if prompt_logprobs is None and echo is not None:
        prompt_logprobs = logprobs   # the echoed prompt's tokens get logprobs as the output's do
    options = f.optional_object("stream_options")
    if options is not None and not stream:
        raise InvalidRequestError("stream_options can only be set when stream is true", "stream_options")
    include_usage = options is not None and options.bool("include_usage", False)
    salt = f.optional_str("cache_salt")
    kv_transfer_params = f.raw("kv_transfer_params")
    kv_transfer = parse_kv_transfer_params(kv_transfer_params)
    prefix = "cmpl" if endpoint is Endpoint.COMPLETIONS else "chatcmpl"
    return ParsedRequest(
        endpoint=endpoint,
        engine_request=EngineRequest(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            prompt_token_ids=prompt,
            sampling=sampling_params(f, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                     engine=engine, remote_decode=isinstance(kv_transfer, RemoteDecodeParams)),
            kv_transfer=kv_transfer,
            cache_salt=None if salt is None else salt.encode("utf-8"),
        ),
        created=int(time.time()),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=include_usage and options is not None and options.bool("continuous_usage_stats", False),
        return_token_ids=f.bool("return_token_ids", False),
        tokens_as_ids=f.bool("return_tokens_as_token_ids", False),
        stream_head=parse_stream_head(kv_transfer_params, stream=stream),
        echo=echo,
    )


def parse_completion_request(body: dict[str, Any], engine: EngineClient, model_names: Collection[str]) -> ParsedRequest:
    f = Fields(body)
    check_model(f, model_names)
    echoes = f.bool("echo", False)
    logprobs = f.optional_int("logprobs", minimum=0, maximum=MAX_LOGPROBS)
    given_prompt = parse_prompt(f.raw("prompt"), engine, f.bool("add_special_tokens", True))
    prompt = _truncated(given_prompt, f, engine.max_model_len)
    max_tokens = f.optional_int("max_tokens", minimum=0 if echoes else 1)
    echo = None
    if echoes:
        given = one_prompt(f.raw("prompt"))
        whole = isinstance(given, str) and prompt == given_prompt
        text = given if whole else engine.tokenizer.decode(prompt)
        echo = Echo(text, without_output=max_tokens == 0)
        if max_tokens == 0:
            max_tokens = 1
    budget = output_budget(len(prompt), max_tokens, "max_tokens", engine, Endpoint.COMPLETIONS)
    return _common(f, Endpoint.COMPLETIONS, prompt, max_tokens=budget, logprobs=logprobs, engine=engine, echo=echo)


def parse_chat_request(body: dict[str, Any], engine: EngineClient, model_names: Collection[str],
                       tool_parsing: ToolParsing = ToolParsing(),
                       templating: ChatTemplating = ChatTemplating()) -> ParsedRequest:
    f = Fields(body)
    check_model(f, model_names)
    top_logprobs = f.optional_int("top_logprobs", minimum=0, maximum=MAX_LOGPROBS)
    wants_logprobs = f.bool("logprobs", False)
    if top_logprobs is not None and not wants_logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs set to true", "top_logprobs")
    param = "max_completion_tokens" if f.raw("max_completion_tokens") is not None else "max_tokens"
    max_tokens = f.optional_int(param, minimum=1)
    tools = tool_use(f, tool_parsing)
    messages = parse_messages(f.raw("messages"))
    prompt = chat_prompt(messages, engine, f, add_special_tokens=f.bool("add_special_tokens", False),
                         tools=tools.tools if tools is not None else None, templating=templating)
    prompt = _truncated(prompt, f, engine.max_model_len)
    parsed = _common(f, Endpoint.CHAT, prompt, max_tokens=output_budget(len(prompt), max_tokens, param, engine,
                                                                         Endpoint.CHAT),
                     logprobs=(top_logprobs or 0) if wants_logprobs else None, engine=engine)
    if f.bool("echo", False) and messages[-1]["role"] == "assistant" and messages[-1]["content"]:
        parsed = replace(parsed, echo=Echo(messages[-1]["content"], without_output=False))
    if f.bool("add_generation_prompt", True):   # as vLLM: the role the generation prompt opened, else the last turn's
        parsed = replace(parsed, role=templating.response_role)
    else:
        parsed = replace(parsed, role=messages[-1]["role"])
    return parsed if tools is None else _with_tools(parsed, tools, f)


def _with_tools(parsed: ParsedRequest, tools: ToolUse, f: Fields) -> ParsedRequest:
    """A named or "required" tool choice constrains the output in place of any `response_format` (as vLLM); beside
    a `structured_outputs` constraint it is refused, as vLLM refuses it. Calls read from the model's own format keep
    its special tokens in the text (vLLM's `granite4` parser asks for them too)."""
    sampling = parsed.engine_request.sampling
    if tools.constrained:
        if f.raw("structured_outputs") is not None:
            raise InvalidRequestError("structured_outputs and a named or \"required\" tool_choice both constrain the "
                                      "output: send one", "tool_choice")
        sampling = replace(sampling, constraint=tools.constraint())
    elif tools.parser is not None:
        sampling = replace(sampling, skip_special_tokens=False)
    return replace(parsed, tool_use=tools, engine_request=replace(parsed.engine_request, sampling=sampling))


@dataclass(frozen=True)
class TokenizeRequest:
    tokens: tuple[int, ...]
    token_strs: bool   # the answer also names each token (`return_token_strs`)


def parse_tokenize_request(body: dict[str, Any], engine: EngineClient, model_names: Collection[str],
                           templating: ChatTemplating = ChatTemplating()) -> TokenizeRequest:
    """vLLM's `/tokenize`: a prompt string (special tokens added unless `add_special_tokens` is false) or chat
    messages (rendered as a chat request renders them: `add_generation_prompt`, `continue_final_message`, `tools`;
    no special tokens beyond the template's unless `add_special_tokens`)."""
    f = Fields(body)
    check_model(f, model_names)
    token_strs = f.bool("return_token_strs", False)
    if f.raw("messages") is not None:
        tokens = chat_prompt(parse_messages(f.raw("messages")), engine, f,
                             add_special_tokens=f.bool("add_special_tokens", False), tools=tools_field(f.raw("tools")),
                             templating=templating)
        return TokenizeRequest(tokens, token_strs)
    prompt = f.optional_str("prompt")
    if prompt is None:
        raise InvalidRequestError("tokenize needs a prompt string or messages", "prompt")
    add_special_tokens = f.bool("add_special_tokens", True)
    return TokenizeRequest(tuple(engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)), token_strs)


def parse_detokenize_request(body: dict[str, Any], engine: EngineClient, model_names: Collection[str]) -> tuple[int, ...]:
    """vLLM's `/detokenize`: `tokens`, ids of the model's vocabulary (an empty list decodes to "")."""
    f = Fields(body)
    check_model(f, model_names)
    tokens = f.raw("tokens")
    if not isinstance(tokens, list):
        raise InvalidRequestError("tokens must be a list of token ids", "tokens")
    return _token_ids(tokens, engine.vocab_size, "tokens")


def invoked_endpoint(body: dict[str, Any]) -> Endpoint:
    """The route a SageMaker `/invocations` body is for, as vLLM tells them apart: chat when it has `messages`, else
    completions when it has `prompt`."""
    if "messages" in body:
        return Endpoint.CHAT
    if "prompt" in body:
        return Endpoint.COMPLETIONS
    raise InvalidRequestError("Cannot find suitable handler for request. Expected one of: a chat completions body "
                              "(with messages) or a completions body (with prompt)")


def parse_choices(body: dict[str, Any], endpoint: Endpoint, engine: EngineClient, model_names: Collection[str],
                  tool_parsing: ToolParsing = ToolParsing(),
                  templating: ChatTemplating = ChatTemplating()) -> list[ParsedRequest]:
    """A body's engine requests: one, or one per choice when it asks for several (`n` > 1, several prompts)."""
    f = Fields(body)
    n = f.int("n", 1, minimum=1, maximum=MAX_N)
    prompts = several_prompts(body.get("prompt")) if endpoint is Endpoint.COMPLETIONS else None

    def parse(one: dict[str, Any]) -> ParsedRequest:
        if endpoint is Endpoint.COMPLETIONS:
            return parse_completion_request(one, engine, model_names)
        return parse_chat_request(one, engine, model_names, tool_parsing, templating)
    if n == 1 and prompts is None:
        return [parse(body)]
    if f.raw("kv_transfer_params") is not None:
        param = "n" if n > 1 else "kv_transfer_params"
        raise InvalidRequestError("kv_transfer_params go with a single prompt and n 1 (a P/D proxy splits a body "
                                  "of several choices into requests of one)", param)
    parsed = [parse({**body, "prompt": prompt} if prompts else body) for prompt in prompts or (None,)]
    if n > 1 and parsed[0].engine_request.sampling.temperature < GREEDY_TEMPERATURE:   # n copies of one answer
        raise InvalidRequestError(f"n must be 1 when using greedy sampling, got {n}.", "n")
    response_id, created = parsed[0].request_id, parsed[0].created
    return [_sample(one, p * n + i, i, response_id, created) for p, one in enumerate(parsed) for i in range(n)]


def _sample(parsed: ParsedRequest, index: int, sample: int, response_id: str, created: int) -> ParsedRequest:
    """Sample `sample` of a parsed prompt as choice `index`: its own engine request id, and its seed + sample."""
    request = parsed.engine_request
    seed = request.sampling.seed
    if seed is not None:
        seed = sample_seed(seed, sample)
    return replace(parsed, created=created, choice=Choice(index, sample, response_id), engine_request=replace(
        request, request_id=f"{request.request_id}-{index}" if index else request.request_id,
        sampling=replace(request.sampling, seed=seed)))
