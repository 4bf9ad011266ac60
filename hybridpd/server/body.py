"""Reading a request body as one JSON object, strictly: anything else is the client's error (400)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from hybridpd.errors import InvalidRequestError


def _reject_constant(name: str) -> float:
    raise InvalidRequestError(f"invalid JSON: {name} is not a JSON number")


def _is_json_content_type(header: str | None) -> bool:
    """A missing Content-Type is accepted (curl without -H); otherwise JSON or a `+json` type."""
    if header is None:
        return True
    mime = header.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        raise InvalidRequestError("the request body is not valid UTF-8") from exc
    except RecursionError as exc:
        raise InvalidRequestError("invalid JSON: nested too deeply") from exc
    except ValueError as exc:  # json.JSONDecodeError, and the int digit limit
        raise InvalidRequestError(f"invalid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidRequestError(f"the request body must be a JSON object, not {type(value).__name__}")
    return value


async def read_json_object(request: web.Request) -> dict[str, Any]:
    if not _is_json_content_type(request.headers.get("Content-Type")):
        raise InvalidRequestError(
            f"unsupported Content-Type {request.headers['Content-Type']!r}: send application/json"
        )
    return parse_json_object(await request.read())
