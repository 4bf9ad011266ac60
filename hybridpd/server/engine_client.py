"""What the HTTP server needs from an engine: the contract the real engine and the test fake both meet."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

from hybridpd.engine.request import EngineRequest, RequestOutput


class Tokenizer(Protocol):
    eos_token_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The prompt text for `messages` ([{"role": str, "content": str}]); raises InvalidRequestError when the
        template rejects the conversation."""
        ...


class EngineClient(Protocol):
    model_name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int

    def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """An async generator of the request's outputs; the last has `finished=True`.

        Raises InvalidRequestError before its first yield for input the engine rejects. Closing it early
        (`aclose()`, the client went away) aborts the request and frees its blocks. A request that fails ends
        with `finish_reason=ERROR` and `error` set.
        """
        ...

    def healthy(self) -> bool: ...
