"""The one place where the proxy turns errors into HTTP answers (OpenAI's error shape)."""

from __future__ import annotations

import json

from aiohttp import web

from hybridpd.proxy.errors import FailureKind, UpstreamError, UpstreamRejectedError

_GATEWAY_STATUS = {
    FailureKind.UNREACHABLE: (502, "bad_gateway"),
    FailureKind.SERVER_ERROR: (502, "bad_gateway"),
    FailureKind.BAD_ANSWER: (502, "bad_gateway"),
    FailureKind.TIMEOUT: (504, "gateway_timeout"),
}


def error_body(message: str, error_type: str, code: int) -> dict[str, dict[str, object]]:
    return {"error": {"message": message, "type": error_type, "code": code}}


def error_response(status: int, message: str, error_type: str, request_id: str) -> web.Response:
    return web.json_response(
        error_body(message, error_type, status), status=status, headers={"X-Request-Id": request_id}
    )


def invalid_request(message: str, request_id: str) -> web.Response:
    return error_response(400, message, "invalid_request_error", request_id)


def no_upstream(reason: str, request_id: str) -> web.Response:
    """No node of a role can take the request (a discovered pool that is empty, or every node already failed)."""
    return error_response(503, f"no node available: {reason}", "service_unavailable", request_id)


def upstream_failed(error: UpstreamError, request_id: str) -> web.Response:
    status, error_type = _GATEWAY_STATUS[error.kind]
    return error_response(status, str(error), error_type, request_id)


def upstream_rejected(error: UpstreamRejectedError, request_id: str) -> web.Response:
    """The node's 4xx answer, byte for byte."""
    return web.Response(
        status=error.status, body=error.body, headers={"Content-Type": error.content_type, "X-Request-Id": request_id}
    )


def sse_error_event(error: UpstreamError) -> bytes:
    """What a stream that already started gets when its decode node fails: an error event, then [DONE]."""
    status, error_type = _GATEWAY_STATUS[error.kind]
    payload = json.dumps(error_body(str(error), error_type, status))
    return f"data: {payload}\n\ndata: [DONE]\n\n".encode()
