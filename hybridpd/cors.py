"""CORS as vLLM's server answers it (Starlette's CORSMiddleware with vLLM's flags and defaults: every origin, method
and header allowed, no credentials), on the node and the proxy: a browser page on another origin can call either.

- A preflight (`OPTIONS` with `Access-Control-Request-Method`) is answered here, before routing and before the API
  key is asked for: 200 with the allowed methods and headers (the requested ones when all are allowed), or 400
  `Disallowed CORS origin, method, headers` naming what is not allowed.
- Any other request with an `Origin` gets `Access-Control-Allow-Origin` on its answer (streams too): `*` when every
  origin is allowed (the origin itself when credentials are allowed), the origin when it is one of those allowed,
  nothing when it is not; every answer says `Vary: Origin`.
Header for header what vLLM 0.32's server (Starlette 1.10) answers: tests/unit/server/test_cors.py runs Starlette's
middleware beside ours.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "QUERY")
SAFELISTED_HEADERS = frozenset({"Accept", "Accept-Language", "Content-Language", "Content-Type"})
PREFLIGHT_VARY = ("Origin, Access-Control-Request-Method, Access-Control-Request-Headers, "
                  "Access-Control-Request-Private-Network")
MAX_AGE = "600"


@dataclass(frozen=True)
class CorsPolicy:
    origins: tuple[str, ...] = ("*",)
    credentials: bool = False
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)

    @property
    def any_origin(self) -> bool:
        return "*" in self.origins

    def allows_origin(self, origin: str) -> bool:
        return self.any_origin or origin in self.origins

    def _methods(self) -> tuple[str, ...]:
        return ALL_METHODS if "*" in self.methods else self.methods

    def preflight(self, request: web.Request) -> web.Response:
        """The answer to a preflight request (one with an `Origin`)."""
        origin = request.headers["Origin"]
        explicit = not self.any_origin or self.credentials   # the origin itself rather than `*`
        listed = sorted(SAFELISTED_HEADERS | set(self.headers))
        headers = {"Vary": PREFLIGHT_VARY, **({} if explicit else {"Access-Control-Allow-Origin": "*"}),
                   "Access-Control-Allow-Methods": ", ".join(self._methods()), "Access-Control-Max-Age": MAX_AGE}
        if "*" not in self.headers:
            headers["Access-Control-Allow-Headers"] = ", ".join(listed)
        if self.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        failures = []
        if not self.allows_origin(origin):
            failures.append("origin")
        elif explicit:
            headers["Access-Control-Allow-Origin"] = origin
        if request.headers["Access-Control-Request-Method"] not in self._methods():
            failures.append("method")
        asked = request.headers.get("Access-Control-Request-Headers")
        if asked is not None and "*" in self.headers:
            headers["Access-Control-Allow-Headers"] = asked
        elif asked is not None and any(h.strip() not in {x.lower() for x in listed} for h in asked.lower().split(",")):
            failures.append("headers")
        if "Access-Control-Request-Private-Network" in request.headers:
            failures.append("private-network")
        if failures:
            return web.Response(status=400, text=f"Disallowed CORS {', '.join(failures)}", headers=headers)
        return web.Response(status=200, text="OK", headers=headers)

    def add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        """An answer's CORS headers: the allowed origin for a request from one (`*`, or the origin itself when
        credentials are allowed or only some origins are), and `Vary: Origin`."""
        origin = request.headers.get("Origin")
        if origin is not None:
            if self.any_origin:
                response.headers["Access-Control-Allow-Origin"] = "*"
            if self.credentials:
                response.headers["Access-Control-Allow-Credentials"] = "true"
            if self.allows_origin(origin) and (self.credentials or not self.any_origin):
                response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Vary"] = ", ".join([*response.headers.getall("Vary", []), "Origin"])


def install(app: web.Application, policy: CorsPolicy) -> None:
    """`policy` on `app`: preflights answered by a middleware placed first (before the API key's), every other
    answer's headers added as it is prepared."""

    @web.middleware
    async def preflight(request: web.Request,
                        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if _is_preflight(request):
            return policy.preflight(request)
        return await handler(request)

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        if not _is_preflight(request):
            policy.add_headers(request, response)

    app.middlewares.insert(0, preflight)
    app.on_response_prepare.append(on_prepare)


def _is_preflight(request: web.Request) -> bool:
    return (request.method == "OPTIONS" and "Origin" in request.headers
            and "Access-Control-Request-Method" in request.headers)


def add_cors_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """vLLM's four CORS flags, each a JSON list (as vLLM's)."""
    parser.add_argument("--allowed-origins", type=_json_list("--allowed-origins"), default=["*"], metavar="JSON",
                        help="origins a browser page may call from, a JSON list (vLLM's flag; default [\"*\"])")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="let browsers send credentials (cookies) across origins (vLLM's flag)")
    parser.add_argument("--allowed-methods", type=_json_list("--allowed-methods"), default=["*"], metavar="JSON",
                        help="methods allowed across origins, a JSON list (vLLM's flag; default [\"*\"])")
    parser.add_argument("--allowed-headers", type=_json_list("--allowed-headers"), default=["*"], metavar="JSON",
                        help="request headers allowed across origins, a JSON list (vLLM's flag; default [\"*\"])")


def policy_from_args(args: argparse.Namespace) -> CorsPolicy:
    return CorsPolicy(tuple(args.allowed_origins), args.allow_credentials, tuple(args.allowed_methods),
                      tuple(args.allowed_headers))


def _json_list(flag: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON list of strings, such as '[\"*\"]'")
        return value
    return parse
