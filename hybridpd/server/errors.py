"""The one place where exceptions become HTTP errors, in OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}` with `code` the HTTP status; on the Anthropic Messages paths in
Anthropic's (`{"type": "error", "error": {"type", "message"}}`, message_bodies.anthropic_error).

Anything not listed is a bug on our side: 500 "internal error", logged with its traceback, never shown.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from hybridpd.errors import (
    EngineDeadError,
    ForbiddenError,
    InvalidRequestError,
    KVTransferError,
    NotFoundError,
    ServerOverloadedError,
    UnauthorizedError,
)
from hybridpd.message_bodies import anthropic_error, is_messages_path

log = logging.getLogger(__name__)


class ModelNotFoundError(NotFoundError):
    """The body names a model this node does not serve (404 `model_not_found`): vLLM's message, the names the node
    does serve included, with every absolute path in it shown as `<path>` (a model named by its directory is, and
    vLLM keeps the server's paths out of its error messages too)."""

    def __init__(self, model: str, served: Collection[str]) -> None:
        super().__init__(_ABSOLUTE_PATH.sub("<path>", f"The model `{model}` does not exist. Valid aliases: "
                                                      f"{', '.join(served)}."))


_ABSOLUTE_PATH = re.compile(r"/[\w.\-]+(?:/[\w.\-]+)+(?<!\.)")   # a sentence's full stop is not in it


@dataclass(frozen=True, kw_only=True)
class HTTPError:
    status: int
    type: str
    message: str
    param: str | None = None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def response(self, path: str = "") -> web.Response:
        """The error answered on `path`: in Anthropic's shape on its Messages paths."""
        body = anthropic_error(self.status, self.message) if is_messages_path(path) else self.body()
        return web.json_response(body, status=self.status)


# Order does not matter: the lookup walks each exception's MRO, so the most specific class wins.
_STATUS_AND_TYPE: dict[type[BaseException], tuple[int, str]] = {
    InvalidRequestError: (400, "invalid_request_error"),
    UnauthorizedError: (401, "authentication_error"),
    ForbiddenError: (403, "permission_error"),
    ModelNotFoundError: (404, "model_not_found"),
    NotFoundError: (404, "not_found_error"),
    ServerOverloadedError: (503, "server_overloaded"),
    KVTransferError: (502, "kv_transfer_error"),
    EngineDeadError: (500, "engine_dead"),
}

_AIOHTTP_TYPES = {
    404: "not_found_error",
    405: "method_not_allowed",
    413: "request_too_large",
}


def _param(exc: BaseException) -> str | None:
    if isinstance(exc, InvalidRequestError):
        return exc.param
    return "model" if isinstance(exc, ModelNotFoundError) else None


def http_error_for(exc: BaseException) -> HTTPError:
    """The HTTP error for `exc`; logs (with traceback) every exception that is not a known, typed one."""
    if isinstance(exc, web.HTTPException):
        return HTTPError(status=exc.status, type=_AIOHTTP_TYPES.get(exc.status, "invalid_request_error"),
                         message=exc.reason if exc.text is None else exc.text.removeprefix(f"{exc.status}: "))
    for cls in type(exc).__mro__:
        if cls in _STATUS_AND_TYPE:
            status, kind = _STATUS_AND_TYPE[cls]
            return HTTPError(status=status, type=kind, message=str(exc), param=_param(exc))
    log.error("internal error while serving a request", exc_info=exc)
    return HTTPError(status=500, type="internal_error", message="internal error")


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Turns every exception a handler raises (and aiohttp's own 404/405/413) into a JSON error response."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return http_error_for(exc).response(request.path)
    except Exception as exc:  # noqa: BLE001 - this is the one place that maps every error
        return http_error_for(exc).response(request.path)
