"""The one place where the proxy turns errors into HTTP answers: OpenAI's error shape, Anthropic's on its Messages
paths (as the nodes answer there)."""

from __future__ import annotations

import json

from aiohttp import web

from hybridpd.message_bodies import MESSAGES_PATH, anthropic_error, is_messages_path
from hybridpd.proxy.errors import FailureKind, UpstreamError, UpstreamRejectedError
from hybridpd.proxy.routing import NoUpstreamError
from hybridpd.response_bodies import RESPONSES_PATH

_GATEWAY_STATUS = {
    FailureKind.UNREACHABLE: (502, "bad_gateway"),
    FailureKind.SERVER_ERROR: (502, "bad_gateway"),
    FailureKind.BAD_ANSWER: (502, "bad_gateway"),
    FailureKind.TIMEOUT: (504, "gateway_timeout"),
}


def error_body(message: str, error_type: str, code: int) -> dict[str, dict[str, object]]:
    return {"error": {"message": message, "type": error_type, "code": code}}


def error_response(status: int, message: str, error_type: str, request_id: str, path: str = "") -> web.Response:
    body = anthropic_error(status, message) if is_messages_path(path) else error_body(message, error_type, status)
    return web.json_response(body, status=status, headers={"X-Request-Id": request_id})


def invalid_request(message: str, request_id: str, path: str = "") -> web.Response:
    return error_response(400, message, "invalid_request_error", request_id, path)


def no_upstream(reason: str, request_id: str, path: str = "") -> web.Response:
    """No node of a role can take the request (a discovered pool that is empty, or every node already failed)."""
    return error_response(503, f"no node available: {reason}", "service_unavailable", request_id, path)


def upstream_failed(error: UpstreamError, request_id: str, path: str = "") -> web.Response:
    status, error_type = _GATEWAY_STATUS[error.kind]
    return error_response(status, str(error), error_type, request_id, path)


def upstream_rejected(error: UpstreamRejectedError, request_id: str) -> web.Response:
    """The node's 4xx answer, byte for byte."""
    return web.Response(
        status=error.status, body=error.body, headers={"Content-Type": error.content_type, "X-Request-Id": request_id}
    )


def _failure(error: UpstreamError | NoUpstreamError) -> tuple[int, str, str]:
    """(status, error type, message) of a failed or impossible call."""
    if isinstance(error, NoUpstreamError):
        return 503, "service_unavailable", f"no node available: {error}"
    (status, error_type), message = _GATEWAY_STATUS[error.kind], str(error)
    return status, error_type, message


def sse_error_event(error: UpstreamError | NoUpstreamError) -> bytes:
    """What a stream that already started gets when its decode node fails (or none is left): an error event, then
    [DONE]."""
    status, error_type, message = _failure(error)
    return _sse_event_and_done(json.dumps(error_body(message, error_type, status)).encode())


def responses_error_event(error: UpstreamError | NoUpstreamError, sequence_number: int) -> bytes:
    """The same for a Responses stream: a typed `error` event numbered after the events the client has (a Responses
    stream ends without [DONE]), as a node writes its own."""
    _, error_type, message = _failure(error)
    event = {"type": "error", "code": error_type, "message": message, "param": None,
             "sequence_number": sequence_number}
    return f"event: error\ndata: {json.dumps(event)}\n\n".encode()


def messages_error_event(error: UpstreamError | NoUpstreamError) -> bytes:
    """The same for an Anthropic Messages stream: its `error` event (such a stream ends without [DONE])."""
    status, _, message = _failure(error)
    return f"event: error\ndata: {json.dumps(anthropic_error(status, message))}\n\n".encode()


def relay_error_event(path: str, error: UpstreamError | NoUpstreamError, relayed: int) -> bytes:
    """The error event that ends a stream whose decode node failed after `relayed` events: a Responses stream's
    typed one, a Messages stream's Anthropic one, else a chat or completion stream's (and [DONE])."""
    if path == RESPONSES_PATH:
        return responses_error_event(error, relayed)
    return messages_error_event(error) if path == MESSAGES_PATH else sse_error_event(error)


class EventCount:
    """How many server-sent events the bytes fed so far hold (each ends with a blank line), across chunks that split
    an event's end."""

    def __init__(self) -> None:
        self.events = 0
        self._tail = b""   # a newline the last chunk ended with that no blank line took yet

    def feed(self, chunk: bytes) -> None:
        data = self._tail + chunk
        self.events += data.count(b"\n\n")
        trailing = len(data) - len(data.rstrip(b"\n"))
        self._tail = b"\n" if trailing % 2 else b""


def sse_rejected_event(error: UpstreamRejectedError) -> bytes:
    """A decode node's 4xx once the stream has started: its error body as an event (when it is an OpenAI error
    object; else one of ours with its status), then [DONE]."""
    try:
        body = json.loads(error.body)
    except ValueError:
        body = None
    if not (isinstance(body, dict) and isinstance(body.get("error"), dict)):
        text = error.body.decode("utf-8", "replace")[:300]
        body = error_body(f"{error.upstream.name} refused the request: HTTP {error.status}: {text}",
                          "invalid_request_error", error.status)
    return _sse_event_and_done(json.dumps(body).encode())


def _sse_event_and_done(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\ndata: [DONE]\n\n"
