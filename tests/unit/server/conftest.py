from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from hybridpd.server.app import create_app
from hybridpd.server.args import NodeConfigs, add_arguments, configs_from_args
from hybridpd.server.config import ServerConfig

from .fake_engine import FakeEngine

MODEL = "fake-model"


def typed_events(raw: str) -> list[dict[str, Any]]:
    """A stream of typed events (Responses, Messages): `event: <type>` then `data: <json>`, the two types the same;
    no [DONE]."""
    events = []
    for block in raw.split("\n\n")[:-1]:
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    return events


def serve_parser() -> argparse.ArgumentParser:
    """`hybridpd serve`'s flags."""
    parser = argparse.ArgumentParser(prog="hybridpd serve")
    add_arguments(parser)
    return parser


def serve_configs(argv: list[str]) -> NodeConfigs:
    """What `hybridpd serve ARGV` configures (the model directory, unless given: /models/default-preset)."""
    return configs_from_args(serve_parser().parse_args(argv), default_model_dir=lambda: Path("/models/default-preset"))


def make_app(engine: FakeEngine, **config: Any):
    return create_app(engine, ServerConfig(served_model_name=MODEL, port=0, **config), CollectorRegistry())


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def client(engine: FakeEngine) -> AsyncIterator[TestClient]:
    client = TestClient(TestServer(make_app(engine)))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


def parse_sse(raw: str) -> list[Any]:
    """The payloads of an SSE body: JSON objects, and the final "[DONE]" as a string."""
    assert raw.endswith("\n\n"), raw[-80:]
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
    return events
