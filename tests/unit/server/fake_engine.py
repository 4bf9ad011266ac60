"""An in-process engine that meets `EngineClient`, with knobs for every path the server must handle, and a record
of what happened to each request (so tests can see that a disconnect closed the generator)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from hybridpd.engine.model.generation_config import GenerationDefaults
from hybridpd.engine.request import EngineRequest, FinishReason, RequestOutput, TokenLogprob
from hybridpd.errors import InvalidRequestError, KVTransferError

EOS = 256


class ByteTokenizer:
    """Bytes are tokens 0..255; 256 is EOS; 257..259 are unused specials."""

    eos_token_id = EOS
    vocab_size = 260
    decodes_text = True

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return text if skip_special_tokens else text + "".join(f"<{i}>" for i in ids if i >= 256)

    def token_strings(self, ids: list[int]) -> list[str]:
        return [chr(i) if i < 256 else f"<{i}>" for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            template_kwargs: dict | None = None, tools: list[dict] | None = None) -> str:
        """`<role>content` lines, then `<assistant>`; a template kwarg `thinking` adds `<think>` after it; tools, a
        first line `<tools>` with their names."""
        prompt = f"<tools>{','.join(t['function']['name'] for t in tools)}\n" if tools else ""
        prompt += "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        prompt += "<assistant>" if add_generation_prompt else ""
        return prompt + ("<think>" if (template_kwargs or {}).get("thinking") else "")

    def describe(self) -> dict:
        return {"tokenizer_class": "FakeBytes", "eos_token": None, "chat_template": "<{{role}}>"}


def fake_token(index: int) -> int:
    """The fake's i-th output token: 'a', 'b', ... cycling."""
    return ord("a") + index % 26


def fake_prompt_logprobs(request: EngineRequest) -> tuple[TokenLogprob | None, ...] | None:
    """With prompt_logprobs: prompt token i (from 1) at logprob -i / 10, rank i; the top ones 'x', 'y', ... ."""
    n_top = request.sampling.prompt_logprobs
    if n_top is None:
        return None
    return (None, *(TokenLogprob(token_id=token, logprob=-i / 10, rank=i,
                                 top=tuple((ord("x") + k, -0.05 - k) for k in range(n_top)))
                    for i, token in enumerate(request.prompt_token_ids[1:], start=1)))


@dataclass
class FakeEngine:
    model_name: str = "fake-model"
    max_model_len: int = 128
    vocab_size: int = 260
    tokenizer: ByteTokenizer = field(default_factory=ByteTokenizer)
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    # knobs
    is_healthy: bool = True
    raise_before_first: Exception | None = None   # raised at the first anext, like the engine's own rejections
    fail_at_output: int | None = None             # this output (0-based) ends the request with ERROR
    fail_request: int | None = None               # the request that arrived this many (0-based) fails at once
    endless: bool = False                         # ignore max_tokens: yield until closed
    stall_after_first: asyncio.Event | None = None  # after the first output, wait for this event
    stall_before_first: asyncio.Event | None = None  # before the first output (queued, prefilling), wait for it
    num_cached_tokens: int = 0
    textless_outputs: frozenset[int] = frozenset()  # these outputs carry a token but no text (half a character)
    kv_transfer_params: dict | None = None        # put on the finished output (the prefill role's answer)
    spells: str | None = None                     # the outputs spell this text, a character each, then stop
    stop_reason: str | int | None = None          # what ended a spelled text (a stop string, a stop token id)
    # records
    requests: list[EngineRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    aborted_event: asyncio.Event = field(default_factory=asyncio.Event)

    def healthy(self) -> bool:
        return self.is_healthy

    def health_detail(self) -> str:
        return "ok" if self.is_healthy else "engine dead: the test says so"

    def _validate(self, request: EngineRequest) -> None:
        ids = request.prompt_token_ids
        if not ids:
            raise InvalidRequestError("empty prompt", "prompt")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequestError("token id outside the vocabulary", "prompt")
        if len(ids) + request.sampling.max_tokens > self.max_model_len:
            raise InvalidRequestError("prompt + max_tokens is longer than max_model_len", "max_tokens")

    def _output(self, request: EngineRequest, index: int) -> RequestOutput:
        token = fake_token(index) if self.spells is None else ord(self.spells[index])
        stops = self.spells is not None and index + 1 == len(self.spells)
        done = stops or (not self.endless and index + 1 >= request.sampling.max_tokens)
        failed = self.fail_at_output == index or (
            index == 0 and self.fail_request is not None and self.requests.index(request) == self.fail_request)
        n_top = request.sampling.logprobs
        logprobs = () if n_top is None else (
            TokenLogprob(token_id=token, logprob=-0.5, top=tuple((fake_token(index + k), -0.5 - k) for k in range(n_top))),
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt_logprobs=fake_prompt_logprobs(request) if index == 0 and not failed else None,
            new_token_ids=() if failed else (token,),
            new_text="" if failed or index in self.textless_outputs else chr(token),
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=self.num_cached_tokens,
            num_output_tokens=index + (0 if failed else 1),
            finished=done or failed,
            finish_reason=FinishReason.ERROR if failed else (
                FinishReason.STOP if stops else FinishReason.LENGTH if done else None),
            logprobs=() if failed else logprobs,
            stop_reason=self.stop_reason if stops else None,
            kv_transfer_params=self.kv_transfer_params if done else None,
            error=KVTransferError("10.0.0.7:14579", "lease expired") if failed else None,
        )

    async def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        if self.raise_before_first is not None:
            raise self.raise_before_first
        self._validate(request)
        self.requests.append(request)
        finished = False
        try:
            if self.stall_before_first is not None:
                await self.stall_before_first.wait()
            index = 0
            while True:
                output = self._output(request, index)
                yield output
                if output.finished:
                    break
                if index == 0 and self.stall_after_first is not None:
                    await self.stall_after_first.wait()
                await asyncio.sleep(0)
                index += 1
            finished = True
        finally:
            if not finished:
                self.aborted.append(request.request_id)
                self.aborted_event.set()
