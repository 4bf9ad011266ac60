"""Token logprobs in the two OpenAI formats: completions' parallel lists, and chat's list of token objects.

A logprob that is not finite (a token masked out by top-k/top-p) is written as -9999.0, as vLLM does, because
JSON has no -Infinity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from hybridpd.engine.request import TokenLogprob
from hybridpd.engine.tokenizer import Tokenizer

MASKED_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MASKED_LOGPROB


TokenNames = Callable[[int], str]   # how a logprob entry names its token


def token_names(tokenizer: Tokenizer, as_ids: bool = False) -> TokenNames:
    """Each token's text; vLLM's placeholder `token_id:<id>` when asked (`return_tokens_as_token_ids`) or without a
    tokenizer (`--skip-tokenizer-init`)."""
    if as_ids or not tokenizer.decodes_text:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: tokenizer.decode([token_id])


def completion_logprobs(
    logprobs: Sequence[TokenLogprob | None], name: TokenNames, text_offset: int, token_ids: Sequence[int] = ()
) -> tuple[dict[str, Any], int]:
    """`{"text_offset", "token_logprobs", "tokens", "top_logprobs"}` for these tokens, and the offset after them. A
    None entry (an echoed prompt's first token, which nothing predicts) is the token `token_ids` names at its index,
    with null logprobs, as vLLM writes it.

    `text_offset` counts characters of the per-token strings from the start of the completion, so that a
    stream continues where the previous chunk ended.
    """
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for index, entry in enumerate(logprobs):
        if entry is None:
            text = name(token_ids[index])
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            text = name(entry.token_id)
            top = {name(token_id): _finite(lp) for token_id, lp in entry.top}
            top.setdefault(text, _finite(entry.logprob))
            token_logprobs.append(_finite(entry.logprob))
            top_logprobs.append(top)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
    body = {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top_logprobs}
    return body, text_offset


def prompt_logprobs_body(entries: Sequence[TokenLogprob | None], name: TokenNames) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null (the first) or {token id: {"logprob", "rank",
    "decoded_token"}}, the prompt's own token first, then the likeliest ones (ranks 1, 2, ...)."""
    body: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry is None:
            body.append(None)
            continue
        step = {str(entry.token_id): {"logprob": _finite(entry.logprob), "rank": entry.rank,
                                      "decoded_token": name(entry.token_id)}}
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            step.setdefault(str(token_id), {"logprob": _finite(logprob), "rank": rank,
                                            "decoded_token": name(token_id)})
        body.append(step)
    return body


def _chat_token(name: TokenNames, token_id: int, logprob: float) -> dict[str, Any]:
    text = name(token_id)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(logprobs: Sequence[TokenLogprob], name: TokenNames) -> dict[str, Any]:
    """`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}`."""
    return {
        "content": [
            {
                **_chat_token(name, entry.token_id, entry.logprob),
                "top_logprobs": [_chat_token(name, token_id, lp) for token_id, lp in entry.top],
            }
            for entry in logprobs
        ]
    }
