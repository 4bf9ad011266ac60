"""The access log (hybridpd/access_log.py): uvicorn's line per request, as vLLM's server writes it, on a real
listening runner; paths left out by `--disable-access-log-for-endpoints`, none at all with
`--disable-uvicorn-access-log`."""

from __future__ import annotations

import logging
import re

import aiohttp
import pytest
from aiohttp import web

from hybridpd.access_log import LOGGER, runner_kwargs

from .conftest import make_app, serve_configs
from .fake_engine import FakeEngine

LINE = re.compile(r'^127\.0\.0\.1:\d+ - "(GET|POST) (\S+) HTTP/1\.1" (\d{3})$')


async def logged(caplog, enabled: bool, excluded: frozenset[str]) -> list[tuple[str, str, str]]:
    """(method, path, status) of each access line while a client makes four calls."""
    runner = web.AppRunner(make_app(FakeEngine()), **runner_kwargs(enabled, excluded))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    caplog.set_level(logging.INFO, logger=LOGGER.name)
    try:
        async with aiohttp.ClientSession() as session:
            for method, path, body in (("GET", "/health", None), ("GET", "/metrics", None),
                                       ("POST", "/v1/completions?x=1", {"prompt": "x", "max_tokens": 2}),
                                       ("POST", "/v1/completions", {"max_tokens": 2})):
                async with session.request(method, url + path, json=body) as resp:
                    await resp.read()
    finally:
        await runner.cleanup()
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER.name]
    assert all(LINE.match(line) for line in lines), lines
    return [LINE.match(line).groups() for line in lines]


@pytest.mark.parametrize("enabled, excluded, expected", [
    (True, frozenset(), [("GET", "/health", "200"), ("GET", "/metrics", "200"),
                         ("POST", "/v1/completions?x=1", "200"), ("POST", "/v1/completions", "400")]),
    (True, frozenset({"/health", "/metrics"}), [("POST", "/v1/completions?x=1", "200"),
                                                ("POST", "/v1/completions", "400")]),
    (False, frozenset(), []),
])
async def test_access_lines(caplog, enabled, excluded, expected):
    assert await logged(caplog, enabled, excluded) == expected


def test_the_flags():
    def server(argv):
        return serve_configs(argv).server

    assert (server([]).access_log, server([]).access_log_excluded) == (True, frozenset())
    off = server(["--disable-uvicorn-access-log", "--disable-access-log-for-endpoints", "/health, /metrics,"])
    assert (off.access_log, off.access_log_excluded) == (False, frozenset({"/health", "/metrics"}))
