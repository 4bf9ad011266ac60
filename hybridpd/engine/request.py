"""What the engine takes in and gives back: frozen values, enums for states."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from hybridpd.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    FAILED = "failed"


class FinishReason(enum.Enum):
    STOP = "stop"        # EOS or a stop string
    LENGTH = "length"    # max_tokens or max_model_len
    ABORT = "abort"      # client went away, or shutdown
    ERROR = "error"      # a failure (see RequestOutput.error)


@dataclass(frozen=True, kw_only=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    # The parsed `kv_transfer_params` of the HTTP body (a connector dataclass), None for a colocated request.
    kv_transfer: Any = None
    cache_salt: bytes | None = None
    # W3C trace headers of the request's span (hybridpd/tracing.py), opaque to the engine: the connector's spans
    # of this request (lease grant, pull, READ) nest under it. () when tracing is off.
    trace_context: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, kw_only=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None   # 1 + how many tokens the model found likelier (prompt tokens: vLLM reports it)


@dataclass(frozen=True, kw_only=True)
class RequestOutput:
    """One increment of a request's output; the last one has `finished=True`."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None    # the stop string or stop token id that ended it, if one did
    logprobs: tuple[TokenLogprob, ...] = ()
    # With SamplingParams.prompt_logprobs, on the first output only: one entry per prompt token, None for the first
    # (nothing comes before it), as vLLM's `prompt_logprobs`.
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    # For a request prefilled here for a remote decode node: the top-level `kv_transfer_params` to answer.
    kv_transfer_params: dict[str, Any] | None = None
    scheduled_at: float | None = None   # time.monotonic() when the engine first took the request from its queue
    num_preemptions: int = 0            # times the engine preempted it so far
    num_pulled_tokens: int = 0          # of its prompt, what a pull from a prefill node brought (not cached)
    error: Exception | None = field(default=None, compare=False)
