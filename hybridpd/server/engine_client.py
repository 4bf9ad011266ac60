"""What the HTTP server needs from an engine: the contract the real engine (`hybridpd.engine.async_engine`) and
the test fake both meet. The tokenizer's `apply_chat_template` raises InvalidRequestError for a conversation its
template rejects."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

from hybridpd.engine.model.generation_config import GenerationDefaults
from hybridpd.engine.request import EngineRequest, RequestOutput
from hybridpd.engine.tokenizer import Tokenizer


class EngineClient(Protocol):
    model_name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    generation_defaults: GenerationDefaults  # the checkpoint's sampling defaults for fields a request omits

    def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """An async generator of the request's outputs; the last has `finished=True`.

        Raises InvalidRequestError for input the engine rejects: at the call (an engine in this process validates at
        once) or at the first output (the node's engine process validates on its engine thread), never later.
        Closing it early (`aclose()`, the client went away) aborts the request and frees its blocks. A request that
        fails ends with `finish_reason=ERROR` and `error` set.
        """
        ...

    def healthy(self) -> bool: ...

    def health_detail(self) -> str:
        """Why the engine is not healthy, for a person reading `/health` ("ok" when it is)."""
        ...
