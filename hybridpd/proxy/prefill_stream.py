"""A streamed prefill call's answer: the head of the client's stream and the prefill node's kv_transfer_params.

When the client streams, the prefill call streams too (bodies.prefill_body). The node's events are the chat role
chunk (chat only), the first token's chunk — which also carries `kv_transfer_params` and the finish_reason of a
one-token call — and [DONE] (with vLLM's `continuous_usage_stats` every chunk carries the usage so far, and a usage
chunk comes before [DONE]: the call's own, left out). The client's stream begins with those chunks at once, the
call-specific parts taken out (kv_transfer_params; finish_reason and stop_reason back to null: the client's request
goes on), and the decode node continues it under the same id and `created` (hybridpd/stream_head.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hybridpd.stream_head import StreamHead

SSE_CONTENT_TYPE = "text/event-stream"
_DONE = b"[DONE]"


class PrefillStreamError(Exception):
    """The prefill node's stream is unusable; `from_node` when the node itself sent an error event."""

    def __init__(self, message: str, *, from_node: bool = False) -> None:
        super().__init__(message)
        self.from_node = from_node


@dataclass(frozen=True)
class PrefillStream:
    kv_transfer_params: dict[str, Any] | None
    head: bytes                     # SSE events for the client, in order; empty without kv_transfer_params
    stream_head: StreamHead | None  # what the decode node continues; None without kv_transfer_params


def sse_payloads(raw: bytes) -> list[bytes]:
    """The data payloads of an SSE body (one `data:` line per event, as the nodes write them)."""
    payloads = []
    for event in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
        if data:
            payloads.append(b"\n".join(data))
    return payloads


def read_prefill_stream(raw: bytes) -> PrefillStream:
    chunks: list[dict[str, Any]] = []
    params: dict[str, Any] | None = None
    carrier: dict[str, Any] = {}
    for payload in sse_payloads(raw):
        if payload == _DONE:
            break
        try:
            chunk = json.loads(payload)
        except ValueError as exc:
            raise PrefillStreamError(f"an event is not JSON: {payload[:80]!r}") from exc
        if not isinstance(chunk, dict):
            raise PrefillStreamError("an event is not a JSON object")
        if "error" in chunk:
            raise PrefillStreamError(f"the node's stream failed: {json.dumps(chunk['error'])[:300]}", from_node=True)
        if chunk.get("choices") == [] and "usage" in chunk and "kv_transfer_params" not in chunk:
            continue   # the one-token call's own usage: the decode node's stream ends with the client's
        found = chunk.pop("kv_transfer_params", None)
        if found is not None:
            if not isinstance(found, dict):
                raise PrefillStreamError("kv_transfer_params is not an object")
            params, carrier = found, chunk
            for choice in chunk.get("choices") or ():
                choice["finish_reason"] = None
                if "stop_reason" in choice:
                    choice["stop_reason"] = None
        chunks.append(chunk)
    else:
        raise PrefillStreamError("the stream ended without [DONE]")
    if params is None:
        return PrefillStream(kv_transfer_params=None, head=b"", stream_head=None)
    response_id, created = carrier.get("id"), carrier.get("created")
    if not isinstance(response_id, str) or not response_id or isinstance(created, bool) or not isinstance(created, int):
        raise PrefillStreamError("the chunk with kv_transfer_params has no id or created")
    head = b"".join(b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in chunks)
    return PrefillStream(kv_transfer_params=params, head=head, stream_head=StreamHead(response_id, created))
