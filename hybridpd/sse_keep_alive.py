"""SSE keep-alive comments (vLLM's `--sse-keep-alive-interval`): while a stream waits longer than the interval for
its next bytes (queued, in a long prefill, between slow tokens), a comment line goes out, which SSE clients ignore
and which keeps proxies and load balancers with read timeouts (NGINX's `proxy_read_timeout`, an AWS ALB's idle
timeout) from closing the connection.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

KEEP_ALIVE = b": keep-alive\n\n"


def add_keep_alive_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, quiet: str) -> None:
    """vLLM's flag; `quiet` says when a stream goes quiet there."""
    parser.add_argument("--sse-keep-alive-interval", type=float, default=0, metavar="SECONDS",
                        help=f"send an SSE comment (`: keep-alive`) whenever a chat or completions stream has been "
                             f"quiet this long ({quiet}), so that proxies and load balancers with read timeouts keep "
                             f"the connection (vLLM's flag; 0, the default: none)")


def interval_argument(value: float) -> float | None:
    """`--sse-keep-alive-interval`'s seconds as the interval (0: off, None); ValueError when negative or not finite."""
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"--sse-keep-alive-interval must be >= 0 (0: no keep-alive comments), got {value}")
    return value or None


async def awaited(pending: Awaitable[T], interval: float | None, idle: Callable[[], Awaitable[None]]) -> T:
    """`pending`'s result, `idle()` awaited every `interval` seconds it is not there yet (None: a plain await). If
    `idle()` raises (the client went away) or the caller is cancelled, `pending` is cancelled."""
    if interval is None:
        return await pending
    task = asyncio.ensure_future(pending)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=interval)
            if done:
                return task.result()
            await idle()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):   # its outcome no longer matters
                await task
