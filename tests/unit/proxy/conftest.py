"""Fixtures: fake prefill/decode nodes and a proxy in front of them, all on free ports, always torn down."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from hybridpd.proxy.app import PROXY_KEY, Proxy, build_app
from hybridpd.proxy.config import ProxyConfig, Role, Upstream

from .fake_node import Behavior, FakeNode, SilentNode, closed_port

DOWN = None  # a node slot with nobody listening


@dataclass
class Harness:
    url: str
    prefill: list[FakeNode | None]
    decode: list[FakeNode | None]
    prefill_ports: list[int]
    decode_ports: list[int]
    proxy: Proxy
    session: aiohttp.ClientSession


MakeHarness = Callable[..., Coroutine[Any, Any, Harness]]


@pytest.fixture
async def make_harness() -> AsyncIterator[MakeHarness]:
    nodes: list[FakeNode] = []
    runners: list[web.AppRunner] = []
    sessions: list[aiohttp.ClientSession] = []

    async def start(
        prefill: list[Behavior | None], decode: list[Behavior | None], **overrides: Any
    ) -> Harness:
        async def node(behavior: Behavior | None) -> FakeNode | None:
            if behavior is None:
                return None
            fake = SilentNode() if behavior is Behavior.SILENT else FakeNode(behavior)
            nodes.append(fake)
            await fake.start()
            return fake

        prefill_nodes = [await node(b) for b in prefill]
        decode_nodes = [await node(b) for b in decode]
        prefill_ports = [n.port if n else closed_port() for n in prefill_nodes]
        decode_ports = [n.port if n else closed_port() for n in decode_nodes]
        settings: dict[str, Any] = {"prefill_timeout": 5.0, "decode_timeout": 5.0, "connect_timeout": 2.0}
        settings.update(overrides)
        config = ProxyConfig(
            prefillers=tuple(Upstream(role=Role.PREFILL, host="127.0.0.1", port=p) for p in prefill_ports),
            decoders=tuple(Upstream(role=Role.DECODE, host="127.0.0.1", port=p) for p in decode_ports),
            **settings,
        )
        app = build_app(config)
        runner = web.AppRunner(app, handler_cancellation=True)
        runners.append(runner)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        session = aiohttp.ClientSession()
        sessions.append(session)
        return Harness(
            url=f"http://127.0.0.1:{runner.addresses[0][1]}", prefill=prefill_nodes, decode=decode_nodes,
            prefill_ports=prefill_ports, decode_ports=decode_ports, proxy=app[PROXY_KEY], session=session,
        )

    try:
        yield start
    finally:
        for session in sessions:
            await session.close()
        for runner in runners:
            await runner.cleanup()
        for fake in nodes:
            await fake.stop()


def proxy_config(argv: list[str]) -> ProxyConfig:
    """The config `hybridpd proxy ARGV...` would run with (raises ValueError as the command would exit 2)."""
    import argparse

    from hybridpd.proxy.main import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


async def serve_proxy(config: ProxyConfig) -> tuple[web.AppRunner, str]:
    """The proxy app on a free port of 127.0.0.1: (its runner, to clean up; its base URL)."""
    runner = web.AppRunner(build_app(config), handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"
