"""The engine's mutable view of one request as it moves through the scheduler.

States: WAITING -> RUNNING -> FINISHED, with RUNNING -> PREEMPTED -> WAITING when blocks run out (recompute), and
WAITING -> WAITING_FOR_REMOTE_KV -> RUNNING for a request whose prompt was prefilled on another node (it starts
with the first output token that node sampled, and decodes on from it once the prompt's KV has arrived).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from hybridpd.engine.grammar import Grammar
from hybridpd.engine.transfer_params import RemoteDecodeParams, RemotePrefillParams
from hybridpd.engine.request import EngineRequest, FinishReason, RequestStatus, TokenLogprob
from hybridpd.engine.sampling import skip_draw
from hybridpd.engine.sampling_params import SamplingParams


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: bytes | None
    remote_decode: bool                       # prefill role: compute the prompt, sample one token, hold blocks
    remote_prefill: RemotePrefillParams | None  # decode role: pull the prompt's KV from that node
    skip_mamba_align: bool
    generator: torch.Generator | None
    arrival_order: int
    all_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0                # the local prefix hit at (first) admission
    num_pulled_tokens: int = 0                # of its prompt, what a pull from a prefill node brought
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None      # the stop string or stop token id that ended it
    num_preemptions: int = 0
    trace_context: tuple[tuple[str, str], ...] = ()   # EngineRequest.trace_context
    scheduled_at: float | None = None         # time.monotonic() when it first left the waiting queue
    queued_at: float = 0.0                    # time.monotonic() when it reached the scheduler
    uncached_estimate: int = 0                # under SJF: its prompt less the local hit it had then (waiting_order)
    # With sampling.prompt_logprobs: entry i is prompt token i + 1's, filled chunk by chunk until the first output
    # carries them (`prompt_logprobs_sent`).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    grammar: Grammar | None = None            # where its output stands in its constraint (structured outputs): it
                                              # has taken every output token, a remote first token included

    @classmethod
    def from_request(
        cls, request: EngineRequest, *, arrival_order: int, decode_skip_mamba_align: bool, vocab_size: int,
        grammar: Grammar | None = None,
    ) -> Sequence:
        seed = request.sampling.seed
        remote_prefill = request.kv_transfer if isinstance(request.kv_transfer, RemotePrefillParams) else None
        generator = None
        if not request.sampling.greedy:
            generator = torch.Generator()
            if seed is not None:
                generator.manual_seed(seed)
            else:  # from the OS's entropy, this generator only (torch.seed() would reseed the global RNG and, on
                generator.seed()  # the way, format a stack trace for lazy device RNGs: ~80 us per request)
            if remote_prefill is not None:  # the prefill node drew the first token from the same seed
                skip_draw(generator, vocab_size)
        all_token_ids = list(request.prompt_token_ids)
        if remote_prefill is not None:
            all_token_ids.append(remote_prefill.first_token_id)
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            cache_salt=request.cache_salt,
            remote_decode=isinstance(request.kv_transfer, RemoteDecodeParams),
            remote_prefill=remote_prefill,
            skip_mamba_align=remote_prefill is not None and decode_skip_mamba_align,
            generator=generator,
            arrival_order=arrival_order,
            all_token_ids=all_token_ids,
            trace_context=request.trace_context,
            grammar=grammar,
        )

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt length the prefix cache may hit below."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @functools.cached_property
    def prompt_tensor(self) -> torch.Tensor:
        """The prompt's ids as an int64 tensor, made once (a repetition penalty reads them every step)."""
        return torch.tensor(self.prompt_token_ids, dtype=torch.int64)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def scores_prompt(self) -> bool:
        """Its prompt tokens' logprobs are wanted and not yet sent: the prompt is computed, never taken as a hit."""
        return self.sampling.prompt_logprobs is not None and not self.prompt_logprobs_sent

    def record_prompt_logprobs(self, first_target: int, entries: list[TokenLogprob]) -> None:
        """The logprobs of prompt positions `first_target`, `first_target + 1`, ... (a recomputed prompt overwrites
        what its first computation left)."""
        self.prompt_logprobs[first_target - 1 :] = entries

    def append_output(self, token: int) -> None:
        """The token it just drew (its grammar, if any, follows)."""
        self.all_token_ids.append(token)
        if self.grammar is not None:
            self.grammar.accept(token)

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.FAILED)
