"""One streamed request to an OpenAI-compatible endpoint, timed the way `vllm bench serve` times it.

TTFT is from sending to the first chunk that carries a token; ITL is every gap between two such
chunks; latency (E2EL) is from sending to the last such chunk. Output length comes from the final
usage chunk (`completion_tokens`), else the count of token chunks. A stream whose only token's text
was held back (a byte that ends no UTF-8 character) shows it in its finishing chunk alone, with
empty text; when usage then counts tokens, that chunk is the token (as `vllm bench serve`, which
times the first chunk with a choice, counts it). A request never raises: any
failure (HTTP status, error event, broken stream, connection) becomes `success=False` with its text.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from hybridpd.bench.config import EndpointKind
from hybridpd.bench.datasets import SampleRequest
from hybridpd.bench.sse import SSEDecoder, StreamEvent, parse_event

NO_TOKEN_ERROR = "Never received a valid chunk to calculate TTFT. This response will be marked as failed!"


@dataclass(frozen=True, kw_only=True)
class EndpointTarget:
    api_url: str
    kind: EndpointKind
    model: str
    ignore_eos: bool
    sampling: tuple[tuple[str, float | int], ...] = ()


@dataclass(frozen=True, kw_only=True)
class RequestOutput:
    success: bool
    prompt_len: int
    output_len: int
    ttft: float
    itl: tuple[float, ...]
    latency: float
    start_time: float              # perf_counter seconds when the request was sent
    cached_tokens: int | None      # usage.prompt_tokens_details.cached_tokens, None when not reported
    error: str = ""


def build_payload(target: EndpointTarget, sample: SampleRequest) -> dict[str, Any]:
    """The JSON body: streamed, usage included, `max_tokens` = the sample's expected output length."""
    if target.kind is EndpointKind.CHAT:
        if not isinstance(sample.prompt, str):
            raise ValueError("/v1/chat/completions needs text prompts; use --dataset-name custom with text")
        body: dict[str, Any] = {"messages": [{"role": "user", "content": sample.prompt}]}
    else:
        body = {"prompt": sample.prompt_for_wire()}
    body |= {
        "model": target.model,
        "max_tokens": sample.expected_output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.ignore_eos:
        body["ignore_eos"] = True
    return body | dict(target.sampling)


class StreamRecorder:
    """Accumulates one stream's events; `output()` freezes them into a RequestOutput."""

    def __init__(self, start: float, prompt_len: int) -> None:
        self.start = start
        self.prompt_len = prompt_len
        self.token_times: list[float] = []
        self.finish_time: float | None = None
        self.completion_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.error: str | None = None
        self.done = False

    def add(self, event: StreamEvent, now: float) -> None:
        if event.error is not None:
            self.error = event.error
        self.done = self.done or event.done
        if event.carries_token:
            self.token_times.append(now)
        if event.finishes and self.finish_time is None:
            self.finish_time = now
        if event.prompt_tokens is not None:
            self.prompt_len = int(event.prompt_tokens)
        if event.completion_tokens is not None:
            self.completion_tokens = int(event.completion_tokens)
        if event.cached_tokens is not None:
            self.cached_tokens = int(event.cached_tokens)

    def _times(self) -> list[float]:
        if self.token_times or self.finish_time is None or not self.completion_tokens:
            return self.token_times
        return [self.finish_time]

    def output(self) -> RequestOutput:
        times = self._times()
        error = self.error or ("" if times else NO_TOKEN_ERROR)
        return RequestOutput(
            success=not error,
            prompt_len=self.prompt_len,
            output_len=self.completion_tokens if self.completion_tokens is not None else len(times),
            ttft=times[0] - self.start if times else 0.0,
            itl=tuple(b - a for a, b in zip(times, times[1:])),
            latency=times[-1] - self.start if times else 0.0,
            start_time=self.start,
            cached_tokens=self.cached_tokens,
            error=error,
        )


def _failed(start: float, prompt_len: int, error: str) -> RequestOutput:
    return RequestOutput(
        success=False, prompt_len=prompt_len, output_len=0, ttft=0.0, itl=(), latency=0.0,
        start_time=start, cached_tokens=None, error=error,
    )


async def _http_error(response: aiohttp.ClientResponse) -> str:
    body = await response.text()
    try:
        message = json.loads(body)["error"]["message"]
    except (json.JSONDecodeError, KeyError, TypeError):
        message = body.strip()[:500] or (response.reason or "")
    return f"HTTP {response.status}: {message}"


async def send_request(
    session: aiohttp.ClientSession,
    target: EndpointTarget,
    sample: SampleRequest,
    clock: Callable[[], float] = time.perf_counter,
) -> RequestOutput:
    payload = build_payload(target, sample)
    start = clock()
    try:
        async with session.post(target.api_url, json=payload) as response:
            if response.status != 200:
                return _failed(start, sample.prompt_len, await _http_error(response))
            recorder = StreamRecorder(start, sample.prompt_len)
            decoder = SSEDecoder()
            async for chunk in response.content.iter_any():
                now = clock()
                for event_payload in decoder.feed(chunk):
                    recorder.add(parse_event(event_payload, target.kind), now)
                if recorder.error is not None or recorder.done:
                    break
            else:
                for event_payload in decoder.close():
                    recorder.add(parse_event(event_payload, target.kind), clock())
            return recorder.output()
    except Exception as exc:  # noqa: BLE001 - any failure of one request is a data point, not a crash
        return _failed(start, sample.prompt_len, f"{type(exc).__name__}: {exc}")
