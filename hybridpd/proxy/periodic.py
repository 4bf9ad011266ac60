"""The proxy's repeating background jobs (node discovery, the health watch of nodes marked down, the KV event feeds),
each one aiohttp cleanup_ctx: the job starts with the app, runs every `interval` seconds, and is cancelled and
awaited when the app stops. A run that raises is logged and the job goes on at the next interval."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

logger = logging.getLogger(__name__)


class FirstRun(enum.Enum):
    BEFORE_SERVING = "before_serving"   # awaited before the app answers (its failure stops the start-up)
    AT_START = "at_start"               # at once, in the background
    AFTER_INTERVAL = "after_interval"   # one interval after the start


def periodic_context(name: str, run: Callable[[], Awaitable[None]], interval: float, first: FirstRun):
    async def context(_app) -> AsyncIterator[None]:
        if first is FirstRun.BEFORE_SERVING:
            await run()

        async def loop() -> None:
            if first is FirstRun.AT_START:
                await _logged(name, run)
            while True:
                await asyncio.sleep(interval)
                await _logged(name, run)

        task = asyncio.create_task(loop(), name=name)
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    return context


async def _logged(name: str, run: Callable[[], Awaitable[None]]) -> None:
    try:
        await run()
    except Exception:
        logger.exception("%s failed; it runs again at its next interval", name)
