"""Server-sent events off an OpenAI-style stream, and what one event says to the benchmark."""

from __future__ import annotations

import json
from dataclasses import dataclass

from hybridpd.bench.config import EndpointKind

DONE = "[DONE]"


class SSEDecoder:
    """Bytes in (any split), complete `data:` payloads out, in order.

    Events end at a blank line; `\\r\\n` counts as `\\n` (a `\\r` that ends one read waits for its
    `\\n`); lines starting with `:` are comments (pings); several `data:` lines of one event join
    with `\\n`. `close()` returns an unterminated last event, if any.
    """

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer = (self._buffer + chunk).replace(b"\r\n", b"\n")
        *events, self._buffer = self._buffer.split(b"\n\n")
        return [payload for payload in map(self._payload, events) if payload is not None]

    def close(self) -> list[str]:
        rest, self._buffer = self._buffer, b""
        payload = self._payload(rest)
        return [] if payload is None else [payload]

    @staticmethod
    def _payload(event: bytes) -> str | None:
        lines = event.decode("utf-8", errors="replace").split("\n")
        data = [line[5:].removeprefix(" ") for line in lines if line.startswith("data:")]
        return "\n".join(data) if data else None


@dataclass(frozen=True, kw_only=True)
class StreamEvent:
    """One parsed payload. A chunk *carries a token* when it has text, token ids, or (an empty
    text that is still mid-stream, e.g. a byte that ends no UTF-8 character) no finish reason and
    no role-only chat delta; a final empty chunk with a finish reason carries none. It *finishes*
    when its choice has a finish reason."""

    done: bool = False
    carries_token: bool = False
    finishes: bool = False
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None


def _error_message(error: object) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def parse_event(payload: str, kind: EndpointKind) -> StreamEvent:
    """Raises ValueError on a payload that is not JSON (the caller records it as the failure)."""
    if payload.strip() == DONE:
        return StreamEvent(done=True)
    try:
        data = json.loads(payload)
    except json.JSONDecodeError as exc:
        raise ValueError(f"bad stream chunk ({exc.msg}): {payload[:200]!r}") from None
    if not isinstance(data, dict):
        raise ValueError(f"bad stream chunk (not an object): {payload[:200]!r}")
    if "error" in data:
        return StreamEvent(error=_error_message(data["error"]))
    usage = data.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    choices = data.get("choices") or []
    text, carries, finishes = "", False, False
    if choices:
        choice = choices[0]
        if kind is EndpointKind.CHAT:
            delta = choice.get("delta") or {}
            text = delta.get("content") or ""
            mid_stream = choice.get("finish_reason") is None and "role" not in delta
        else:
            text = choice.get("text") or ""
            mid_stream = choice.get("finish_reason") is None
        carries = bool(text) or bool(choice.get("token_ids")) or mid_stream
        finishes = choice.get("finish_reason") is not None
    return StreamEvent(
        carries_token=carries,
        finishes=finishes,
        text=text,
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        cached_tokens=details.get("cached_tokens"),
    )
