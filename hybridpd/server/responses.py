"""Non-streaming answers shaped like vLLM's: `text_completion` and `chat.completion` objects, usage, model list."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridpd.engine.request import FinishReason, RequestOutput, TokenLogprob
from hybridpd.engine.tokenizer import Tokenizer
from hybridpd.server.engine_client import EngineClient
from hybridpd.server.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs_body, token_names
from hybridpd.server.protocol import Endpoint, ParsedRequest
from hybridpd.server.tool_calls import finish_reason as tool_finish_reason, read_whole


@dataclass(frozen=True, kw_only=True)
class FinalOutput:
    """A finished request's outputs joined together."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    kv_transfer_params: dict[str, Any] | None

    @classmethod
    def join(cls, outputs: Sequence[RequestOutput]) -> FinalOutput:
        last = outputs[-1]
        return cls(
            text="".join(o.new_text for o in outputs),
            token_ids=tuple(t for o in outputs for t in o.new_token_ids),
            logprobs=tuple(lp for o in outputs for lp in o.logprobs),
            prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None),
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
            num_prompt_tokens=last.num_prompt_tokens,
            num_cached_tokens=last.num_cached_tokens,
            num_output_tokens=last.num_output_tokens,
            kv_transfer_params=next((o.kv_transfer_params for o in reversed(outputs) if o.kv_transfer_params), None),
        )


def usage(*outputs: RequestOutput | FinalOutput) -> dict[str, Any]:
    """The usage of one request's output, or the sum over several requests'."""
    prompt, completion = sum(o.num_prompt_tokens for o in outputs), sum(o.num_output_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs)},
    }


def finish_reason_value(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


def header(parsed: ParsedRequest, model: str, object_name: str) -> dict[str, Any]:
    return {"id": parsed.response_id, "object": object_name, "created": parsed.response_created, "model": model}


@dataclass(frozen=True)
class CompletionPart:
    """What a completion choice shows of some outputs: its text, and the logprob entries of the tokens `token_ids`
    (None for an echoed prompt's first token)."""

    text: str
    logprobs: tuple[TokenLogprob | None, ...]
    token_ids: tuple[int, ...]


def completion_part(parsed: ParsedRequest, text: str, logprobs: tuple[TokenLogprob, ...], token_ids: tuple[int, ...],
                    prompt_logprobs: tuple[TokenLogprob | None, ...] | None, *, first: bool) -> CompletionPart:
    """The outputs' part as it is, or, the answer's first part with `echo`, after the prompt (its text, and its
    tokens' logprobs when asked); with max_tokens 0 the prompt alone."""
    echo = parsed.echo
    if echo is None or not first:
        return CompletionPart(text, logprobs, token_ids)
    prompt_ids = parsed.engine_request.prompt_token_ids
    if echo.without_output:
        text, logprobs, token_ids = "", (), ()
    echoed = prompt_logprobs if prompt_logprobs is not None else (None,) * len(prompt_ids)
    return CompletionPart(echo.text + text, (*echoed, *logprobs), (*prompt_ids, *token_ids))


def _completion(parsed: ParsedRequest, final: FinalOutput, model: str, tokenizer: Tokenizer) -> dict[str, Any]:
    part = completion_part(parsed, final.text, final.logprobs, final.token_ids, final.prompt_logprobs, first=True)
    name = token_names(tokenizer, parsed.tokens_as_ids)
    logprobs = completion_logprobs(part.logprobs, name, 0, part.token_ids)[0] if parsed.wants_logprobs else None
    choice: dict[str, Any] = {
        "index": 0, "text": part.text, "logprobs": logprobs,
        "finish_reason": finish_reason_value(final.finish_reason), "stop_reason": final.stop_reason,
    }
    if final.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs_body(final.prompt_logprobs, name)
    if parsed.return_token_ids:
        choice["prompt_token_ids"] = list(parsed.engine_request.prompt_token_ids)
        choice["token_ids"] = list(final.token_ids)
    return {**header(parsed, model, "text_completion"), "choices": [choice]}


def _chat(parsed: ParsedRequest, final: FinalOutput, model: str, tokenizer: Tokenizer) -> dict[str, Any]:
    name = token_names(tokenizer, parsed.tokens_as_ids)
    message: dict[str, Any] = {"role": parsed.role, "content": final.text}
    called = False
    tools = read_whole(parsed.tool_use, final.text) if parsed.tool_use is not None else None
    if tools is not None:
        message["content"], called = tools.content, tools.called
        if tools.tool_calls:
            message["tool_calls"] = list(tools.tool_calls)
    if parsed.echo is not None:
        message["content"] = parsed.echo.text + (message["content"] or "")
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": chat_logprobs(final.logprobs, name) if parsed.wants_logprobs else None,
        "finish_reason": tool_finish_reason(parsed.tool_use, called, finish_reason_value(final.finish_reason)),
        "stop_reason": final.stop_reason,
    }
    if parsed.return_token_ids:
        choice["token_ids"] = list(final.token_ids)
    body = {**header(parsed, model, "chat.completion"), "choices": [choice]}
    if final.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_body(final.prompt_logprobs, name)
    return body


_BUILDERS = {Endpoint.COMPLETIONS: _completion, Endpoint.CHAT: _chat}
_OBJECTS = {Endpoint.COMPLETIONS: "text_completion", Endpoint.CHAT: "chat.completion"}


def final_response(parsed: ParsedRequest, final: FinalOutput, model: str, tokenizer: Tokenizer) -> dict[str, Any]:
    """The whole answer; `prompt_token_ids` (with return_token_ids) and `kv_transfer_params` are top-level."""
    body = _BUILDERS[parsed.endpoint](parsed, final, model, tokenizer)
    body["usage"] = usage(final)
    if parsed.return_token_ids:
        body["prompt_token_ids"] = list(parsed.engine_request.prompt_token_ids)
    body["kv_transfer_params"] = final.kv_transfer_params
    return body


def choices_usage(requests: Sequence[ParsedRequest], outputs: Sequence[RequestOutput | FinalOutput]) -> dict[str, Any]:
    """The usage of a body's several choices: each prompt counted once (its first sample's), every output token."""
    prompts = [output for parsed, output in zip(requests, outputs, strict=True) if parsed.counts_prompt]
    body = usage(*prompts)
    completion = sum(output.num_output_tokens for output in outputs)
    return {**body, "completion_tokens": completion, "total_tokens": body["prompt_tokens"] + completion}


def choices_response(requests: Sequence[ParsedRequest], finals: Sequence[FinalOutput], model: str,
                     tokenizer: Tokenizer) -> dict[str, Any]:
    """The answer to a body of several choices (`n` > 1, several prompts): each choice at its index (with its
    `prompt_token_ids` when asked), under the body's one id, the usage counting each prompt once."""
    choices = [{**final_response(parsed, final, model, tokenizer)["choices"][0], "index": parsed.index}
               for parsed, final in zip(requests, finals, strict=True)]
    body = {**header(requests[0], model, _OBJECTS[requests[0].endpoint]), "choices": choices,
            "usage": choices_usage(requests, finals)}
    if requests[0].endpoint is Endpoint.CHAT and finals[0].prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_body(finals[0].prompt_logprobs,
                                                       token_names(tokenizer, requests[0].tokens_as_ids))
    return {**body, "kv_transfer_params": None}


def models_response(engine: EngineClient, names: Sequence[str], created: int) -> dict[str, Any]:
    """/v1/models: a card for each of the model's names, the served one first (as vLLM lists its served names)."""
    return {
        "object": "list",
        "data": [
            {
                "id": name, "object": "model", "created": created, "owned_by": "hybridpd", "root": names[0],
                "parent": None, "max_model_len": engine.max_model_len, "vocab_size": engine.vocab_size,
                "permission": [],
            }
            for name in names
        ],
    }


def tokenize_response(tokens: Sequence[int], token_strs: Sequence[str] | None, max_model_len: int) -> dict[str, Any]:
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": list(tokens),
            "token_strs": None if token_strs is None else list(token_strs)}
