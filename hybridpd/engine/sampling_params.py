"""Per-request sampling parameters, validated where they are built."""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def greedy(self) -> bool:
        """A temperature below 1e-5 is greedy (as in vLLM): dividing logits by it would overflow."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
