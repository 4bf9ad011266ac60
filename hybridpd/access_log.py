"""The access log, a line per answered request as vLLM's server (uvicorn) writes it:
`127.0.0.1:51234 - "POST /v1/chat/completions HTTP/1.1" 200`, logged by `hybridpd.access` at INFO, on the node and
the proxy. vLLM's flags: `--disable-uvicorn-access-log` turns it off, `--disable-access-log-for-endpoints
/health,/metrics` leaves those paths out (matched exactly, without the query string).
"""

from __future__ import annotations

import argparse
import logging

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

LOGGER = logging.getLogger("hybridpd.access")


class UvicornLine(AbstractAccessLogger):
    """uvicorn's line for every request whose path is not left out (`excluded`, set by `access_log_class`)."""

    excluded: frozenset[str] = frozenset()

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        if request.path in self.excluded:
            return
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else (request.remote or "-")
        self.logger.info('%s - "%s %s HTTP/%d.%d" %d', client, request.method, request.path_qs,
                         request.version.major, request.version.minor, response.status)


def access_log_class(excluded: frozenset[str]) -> type[UvicornLine]:
    return type("UvicornLineExcluding", (UvicornLine,), {"excluded": excluded})


def runner_kwargs(enabled: bool, excluded: frozenset[str]) -> dict:
    """The access-log arguments of `web.AppRunner` / `web.run_app`: ours, or none at all."""
    if not enabled:
        return {"access_log": None}
    return {"access_log": LOGGER, "access_log_class": access_log_class(excluded)}


def add_access_log_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="log no line per request (vLLM's flag; the lines are uvicorn's, as vLLM's server "
                             "writes them)")
    parser.add_argument("--disable-access-log-for-endpoints", default="", metavar="PATHS",
                        help="comma-separated paths left out of the access log, e.g. /health,/metrics,/ping "
                             "(vLLM's flag)")


def excluded_paths(text: str) -> frozenset[str]:
    return frozenset(path.strip() for path in text.split(",") if path.strip())
