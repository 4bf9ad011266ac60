"""vLLM's service routes on the node: `/ping` (GET and POST, SageMaker's health check: `/health`'s answer),
`/version`, `/load` (the generation requests in flight under `--enable-server-load-tracking`, else 0), and
`--enable-request-id-headers` (every answer carries X-Request-Id). None of them asks for an API key."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from hybridpd import __version__
from hybridpd.api_keys import ApiKeys

from .conftest import make_app, serve_configs
from .fake_engine import FakeEngine

WAIT = 30   # a guard against a hang, never reached


async def served(engine: FakeEngine, **config) -> TestClient:
    client = TestClient(TestServer(make_app(engine, **config)))
    await client.start_server()
    return client


@pytest.mark.parametrize("healthy, status", [(True, 200), (False, 503)])
async def test_ping_answers_as_health(healthy, status):
    client = await served(FakeEngine(is_healthy=healthy), api_keys=ApiKeys(("k",)))
    try:
        health = await client.get("/health")
        for method in (client.get, client.post):
            ping = await method("/ping")
            assert (ping.status, await ping.json()) == (status, await health.json())
    finally:
        await client.close()


async def test_version():
    client = await served(FakeEngine(), api_keys=ApiKeys(("k",)))
    try:
        assert await (await client.get("/version")).json() == {"version": __version__}
    finally:
        await client.close()


@pytest.mark.parametrize("tracking", [False, True])
async def test_load_counts_the_generation_requests_in_flight(tracking):
    engine = FakeEngine(stall_after_first=asyncio.Event())
    client = await served(engine, load_tracking=tracking)
    try:
        assert await (await client.get("/load")).json() == {"server_load": 0}
        streams = [await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True})
                   for _ in range(2)]
        for stream in streams:   # both requests are past their first output, held there
            await asyncio.wait_for(stream.content.readuntil(b"\n\n"), WAIT)
        await client.post("/tokenize", json={"prompt": "x"})   # not a generation request
        assert await (await client.get("/load")).json() == {"server_load": 2 if tracking else 0}
        engine.stall_after_first.set()
        for stream in streams:
            await stream.read()
        assert await (await client.get("/load")).json() == {"server_load": 0}
    finally:
        await client.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_request_id_headers(stream):
    body = {"prompt": "x", "max_tokens": 2, "stream": stream}
    plain, tagged = await served(FakeEngine()), await served(FakeEngine(), request_id_headers=True)
    try:
        assert "X-Request-Id" not in (await plain.post("/v1/completions", json=body)).headers
        given = await tagged.post("/v1/completions", json=body, headers={"X-Request-Id": "abc-1"})
        made = await tagged.post("/v1/completions", json=body)
        refused = await tagged.post("/v1/completions", json={"max_tokens": 2})
        assert given.headers["X-Request-Id"] == "abc-1"
        assert len(made.headers["X-Request-Id"]) == 32 and refused.status == 400 and refused.headers["X-Request-Id"]
    finally:
        await plain.close()
        await tagged.close()


def test_the_flags():
    def server(argv):
        return serve_configs(argv).server

    assert (server([]).load_tracking, server([]).request_id_headers) == (False, False)
    on = server(["--enable-server-load-tracking", "--enable-request-id-headers"])
    assert (on.load_tracking, on.request_id_headers) == (True, True)


@pytest.mark.parametrize("body, route", [
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}, "/v1/chat/completions"),
    ({"prompt": "x", "max_tokens": 2}, "/v1/completions"),
    ({"prompt": "x", "max_tokens": 2, "stream": True}, "/v1/completions"),
])
async def test_invocations_answers_as_the_route_its_body_is_for(body, route):
    """SageMaker's POST /invocations, as vLLM's: the same answer (ids and times aside) as the route's own."""
    engine = FakeEngine()
    client = await served(engine, api_keys=ApiKeys(("k",)))   # not a /v1 route: no key asked, as vLLM's
    try:
        invoked = await client.post("/invocations", json=body)
        direct = await client.post(route, json=body, headers={"Authorization": "Bearer k"})
        assert invoked.status == direct.status == 200
        assert invoked.headers["Content-Type"] == direct.headers["Content-Type"]
        assert engine.requests[0].prompt_token_ids == engine.requests[1].prompt_token_ids
        if body.get("stream"):
            assert (await invoked.text()).count("data: ") == (await direct.text()).count("data: ")
        else:
            one, two = await invoked.json(), await direct.json()
            assert (one["object"], one["choices"], one["usage"]) == (two["object"], two["choices"], two["usage"])
    finally:
        await client.close()


@pytest.mark.parametrize("body", [{"max_tokens": 2}, {"input": "x"}])
async def test_invocations_refuses_a_body_for_no_route(body):
    engine = FakeEngine()
    client = await served(engine)
    try:
        resp = await client.post("/invocations", json=body)
        assert resp.status == 400 and "Cannot find suitable handler" in (await resp.json())["error"]["message"]
        assert engine.requests == []
    finally:
        await client.close()
