"""Per-request sampling parameters, validated where they are built (vLLM's ranges and messages)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridpd.engine.output_constraint import OutputConstraint
from hybridpd.errors import InvalidRequestError


GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0            # 0 or -1: no top-k
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None   # number of top logprobs per token, None = no logprobs
    min_p: float = 0.0            # drop tokens below min_p x the likeliest one's probability (after temperature)
    presence_penalty: float = 0.0   # minus this for every token the output holds
    frequency_penalty: float = 0.0  # minus this times how often the output holds it
    repetition_penalty: float = 1.0  # a token of the prompt or the output: a logit above 0 divided by it, below times
    min_tokens: int = 0           # EOS and stop_token_ids masked, stop strings not matched, before this many tokens
    stop_token_ids: tuple[int, ...] = ()   # tokens that end the output (finish_reason "stop", stop_reason the id)
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias in [-100, 100]) added to its logit
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be drawn (None: any)
    # The logprob of every prompt token after the first (the model's, given the tokens before it) and the top ones
    # beside it; None = not asked. A request that asks computes its whole prompt (no prefix hit), as in vLLM.
    prompt_logprobs: int | None = None
    # vLLM's bad_words as token sequences (each word with and without a leading space): a sequence's last token is
    # masked wherever the output ends with the tokens before it (a one-token word: always)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    include_stop_str_in_output: bool = False   # a stop string that ends the output stays in its text
    skip_special_tokens: bool = True           # special tokens write no text (False: their text is written out)
    constraint: OutputConstraint | None = None  # what the output must match (structured outputs), None = anything

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be non-negative, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 or positive, got {self.top_k}", "top_k")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError(f"logprobs must be between 0 and 20, got {self.logprobs}", "logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise InvalidRequestError(f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs}",
                                      "prompt_logprobs")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidRequestError(
                f"repetition_penalty must be a finite number above 0, got {self.repetition_penalty}",
                "repetition_penalty")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be between 0 and max_tokens={self.max_tokens}, got {self.min_tokens}", "min_tokens")
        if any(not -100 <= bias <= 100 for _, bias in self.logit_bias):
            raise InvalidRequestError("logit_bias values must be in [-100, 100]", "logit_bias")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise InvalidRequestError("allowed_token_ids must not be empty", "allowed_token_ids")

    @property
    def greedy(self) -> bool:
        """A temperature below 1e-5 is greedy (as in vLLM): dividing logits by it would overflow."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens so far (a penalty)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def shapes_logits(self) -> bool:
        """Whether the logits are changed before sampling (allowed_token_ids, min_tokens' masks, logit_bias,
        penalties, bad words)."""
        return (self.penalized or bool(self.logit_bias) or self.min_tokens > 0
                or self.allowed_token_ids is not None or bool(self.bad_words_token_ids))
