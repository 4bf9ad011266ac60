from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from .fake_openai_server import FakeOpenAIServer


@pytest.fixture
def fake_server() -> Iterator[Callable[..., FakeOpenAIServer]]:
    """A factory: `fake_server(fail_ordinals=...)` starts one; every one started is stopped after the test."""
    started: list[FakeOpenAIServer] = []

    def start(**kwargs: object) -> FakeOpenAIServer:
        server = FakeOpenAIServer(**kwargs)
        started.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in started:
            server.stop()
