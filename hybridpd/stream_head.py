"""A decode-role stream whose head the client already has.

In P/D the prefill node samples the first token. When the client streams, the proxy asks the prefill node for a
stream too and passes its head (the chat role chunk and the first token's chunk) to the client at once, then opens
the decode call with `kv_transfer_params.stream_head = {"id", "created"}`: the decode node continues that stream
under the same response id and `created`, and sends no head of its own (a first output that is also the last sends
one chunk with its finish_reason and whatever text the head held back). Without the field, the decode node streams
the first token itself, as it does for vLLM's toy proxy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridpd.errors import InvalidRequestError

STREAM_HEAD_FIELD = "stream_head"
_NAME = f"kv_transfer_params.{STREAM_HEAD_FIELD}"
_MAX_ID_LENGTH = 256


@dataclass(frozen=True)
class StreamHead:
    """The response id and `created` of the stream the client already has."""

    id: str
    created: int

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "created": self.created}


def parse_stream_head(kv_transfer_params: Any, *, stream: bool) -> StreamHead | None:
    """The request's stream head (None when it has none); InvalidRequestError for a malformed one, or one given to a
    request that does not stream or is not remotely prefilled."""
    if not isinstance(kv_transfer_params, dict) or kv_transfer_params.get(STREAM_HEAD_FIELD) is None:
        return None
    raw = kv_transfer_params[STREAM_HEAD_FIELD]
    if not kv_transfer_params.get("do_remote_prefill"):
        raise InvalidRequestError(f"{_NAME} needs do_remote_prefill", _NAME)
    if not stream:
        raise InvalidRequestError(f"{_NAME} needs stream: true", _NAME)
    if not isinstance(raw, dict):
        raise InvalidRequestError(f"{_NAME} must be an object with id and created", _NAME)
    response_id, created = raw.get("id"), raw.get("created")
    if not isinstance(response_id, str) or not 0 < len(response_id) <= _MAX_ID_LENGTH:
        raise InvalidRequestError(f"{_NAME}.id must be a string of 1-{_MAX_ID_LENGTH} characters", f"{_NAME}.id")
    if isinstance(created, bool) or not isinstance(created, int) or created < 0:
        raise InvalidRequestError(f"{_NAME}.created must be a non-negative integer", f"{_NAME}.created")
    return StreamHead(response_id, created)
