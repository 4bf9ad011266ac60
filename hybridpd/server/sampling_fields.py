"""A request body's sampling fields -> `SamplingParams`, as vLLM reads them; and the fields vLLM honours that this
server does not, which are refused by name rather than ignored (an answer that silently drops `best_of` or `suffix`
is not the answer asked for).

Read: temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, ignore_eos, min_tokens, presence_penalty,
frequency_penalty, repetition_penalty, logit_bias (token id -> bias, clamped to [-100, 100] as vLLM does),
allowed_token_ids, prompt_logprobs, bad_words, include_stop_str_in_output, skip_special_tokens, and the structured
output fields (`structured_outputs`, `response_format`: structured_fields.py). Fields a request omits take the
checkpoint's generation_config.json value where vLLM takes one (temperature, top_p, top_k, min_p and the three
penalties), else vLLM's default.

A request prefilled here for a remote decode node (`kv_transfer_params.do_remote_decode`) comes with max_tokens set
to 1 by the proxy, vLLM's toy proxy included; its min_tokens is cut to that one token, so that its first token is
drawn as the colocated request's would be (EOS masked when min_tokens >= 1) instead of the body being refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hybridpd.engine.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from hybridpd.engine.tokenizer import NO_TOKENIZER, Tokenizer
from hybridpd.errors import InvalidRequestError
from hybridpd.server.engine_client import EngineClient
from hybridpd.server.fields import Fields
from hybridpd.server.structured_fields import output_constraint

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
LOGIT_BIAS_LIMIT = 100.0


def _unset(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


# Fields vLLM acts on that this server does not: each is accepted only at a value that changes nothing.
UNSUPPORTED: dict[str, tuple[Callable[[Any, Mapping[str, Any]], bool], str]] = {
    "best_of": (lambda v, _: v is None or v == 1, "best_of > 1 is not supported"),
    "use_beam_search": (lambda v, _: _unset(v), "beam search is not supported"),
    "suffix": (lambda v, _: v is None or v == "", "suffix is not supported"),
    **{f"guided_{kind}": (lambda v, _: v is None, f"guided_{kind} is not read; send structured_outputs.{kind} (vLLM's "
                                                  "spelling)")
       for kind in ("json", "regex", "choice", "grammar")},
}


def refuse_unsupported(body: Mapping[str, Any]) -> None:
    for name, (harmless, message) in UNSUPPORTED.items():
        if name in body and not harmless(body[name], body):
            raise InvalidRequestError(message, name)


def _stop(value: Any, tokenizer: Tokenizer) -> tuple[str, ...]:
    if value is None or value == []:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequestError("stop must be a non-empty string or a list of non-empty strings", "stop")
    if not tokenizer.decodes_text:
        raise InvalidRequestError(f"{NO_TOKENIZER}: stop strings need the output text", "stop")
    return tuple(stops)


def _token_id_list(f: Fields, key: str, vocab_size: int, *, allow_empty: bool) -> tuple[int, ...] | None:
    value = f.raw(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise f.fail(key, "must be a list of integer token ids")
    if not value and not allow_empty:
        raise f.fail(key, "must not be empty")
    for token in value:
        if not 0 <= token < vocab_size:
            raise f.fail(key, f"holds token id {token}, outside the vocabulary [0, {vocab_size})")
    return tuple(dict.fromkeys(value))


def _logit_bias(f: Fields, vocab_size: int) -> tuple[tuple[int, float], ...]:
    raw = f.optional_object("logit_bias")
    if raw is None:
        return ()
    biases = {}
    for key in raw.obj:
        try:
            token = int(key)
        except ValueError:
            raise f.fail("logit_bias", f"keys must be token ids, got {key!r:.40}") from None
        if not 0 <= token < vocab_size:
            raise f.fail("logit_bias", f"holds token id {token}, outside the vocabulary [0, {vocab_size})")
        bias = raw.float(key, 0.0)
        biases[token] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, bias))
    return tuple(sorted(biases.items()))


def prompt_logprobs_field(f: Fields, stream: bool) -> int | None:
    """`prompt_logprobs` as vLLM takes it: 0 to 20 (vLLM's -1, the whole vocabulary at every prompt position, is not
    served), not with a stream unless 0."""
    value = f.optional_int("prompt_logprobs")
    if value is None:
        return None
    if value == -1:
        raise f.fail("prompt_logprobs", "-1 (the whole vocabulary) is not supported; ask for 0 to 20")
    if stream and value > 0:
        raise InvalidRequestError("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    return value


def _bad_words(value: Any, tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word as it reads at the start of the text and, when that is other
    tokens of the same count, after a space (a word inside the text)."""
    if value is None or value == []:
        return ()
    if not isinstance(value, list) or not all(isinstance(w, str) and w.strip() for w in value):
        raise InvalidRequestError("bad_words must be a list of non-empty strings", "bad_words")
    if not tokenizer.decodes_text:
        raise InvalidRequestError(f"{NO_TOKENIZER}: bad_words need the tokenizer", "bad_words")
    sequences: list[tuple[int, ...]] = []
    for word in value:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return tuple(dict.fromkeys(sequences))


def sampling_params(f: Fields, *, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                    engine: EngineClient, remote_decode: bool) -> SamplingParams:
    defaults, vocab_size = engine.generation_defaults, engine.vocab_size

    def default(value: float | None, fallback: float) -> float:
        return fallback if value is None else value

    temperature = f.float("temperature", default(defaults.temperature, 1.0))
    top_k = f.int("top_k", defaults.top_k or 0, minimum=-1)
    min_tokens = f.int("min_tokens", 0, minimum=0)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if 0 <= temperature < GREEDY_TEMPERATURE else temperature,
        top_p=f.float("top_p", default(defaults.top_p, 1.0)),
        top_k=min(top_k, vocab_size),  # a top_k past the vocabulary keeps every token, as vLLM does
        min_p=f.float("min_p", default(defaults.min_p, 0.0)),
        seed=f.optional_int("seed", minimum=_INT64_MIN, maximum=_INT64_MAX),
        stop=_stop(f.raw("stop"), engine.tokenizer),
        stop_token_ids=_token_id_list(f, "stop_token_ids", vocab_size, allow_empty=True) or (),
        ignore_eos=f.bool("ignore_eos", False),
        min_tokens=min(min_tokens, max_tokens) if remote_decode else min_tokens,
        presence_penalty=f.float("presence_penalty", default(defaults.presence_penalty, 0.0)),
        frequency_penalty=f.float("frequency_penalty", default(defaults.frequency_penalty, 0.0)),
        repetition_penalty=f.float("repetition_penalty", default(defaults.repetition_penalty, 1.0)),
        logit_bias=_logit_bias(f, vocab_size),
        allowed_token_ids=_token_id_list(f, "allowed_token_ids", vocab_size, allow_empty=False),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        bad_words_token_ids=_bad_words(f.raw("bad_words"), engine.tokenizer),
        include_stop_str_in_output=f.bool("include_stop_str_in_output", False),
        skip_special_tokens=f.bool("skip_special_tokens", True),
        constraint=output_constraint(f, engine.tokenizer),
    )
