"""`python -m hybridpd.proxy` as a real process in front of two small in-test nodes; SIGTERM stops it cleanly."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from hybridpd.launcher.ports import free_port
from hybridpd.wire_headers import CLUSTER_TOKEN_HEADER

DEADLINE = 60.0
SSE = b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n'


async def _node(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
        return web.json_response({"kv_transfer_params": {"do_remote_prefill": True, "remote_port": 1}})
    assert body["kv_transfer_params"] == {"do_remote_prefill": True, "remote_port": 1}
    assert request.headers[CLUSTER_TOKEN_HEADER] == "tok"
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    await out.write(SSE)
    return out


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


@pytest.fixture
async def node_port() -> AsyncIterator[int]:
    app = web.Application()
    app.router.add_post("/v1/completions", _node)
    app.router.add_get("/health", _health)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def test_proxy_process_serves_and_stops_on_sigterm(node_port, tmp_path):
    port = free_port()
    token = tmp_path / "token"
    token.write_text("tok\n")
    proxy = subprocess.Popen(
        [sys.executable, "-m", "hybridpd.proxy", "--port", str(port),
         "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(node_port),
         "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(node_port), "--cluster-token-file", str(token)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        async with aiohttp.ClientSession() as session:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + DEADLINE
            while True:
                assert proxy.poll() is None, proxy.stdout.read().decode()
                assert loop.time() < deadline, "the proxy never became healthy"
                try:
                    async with session.get(f"http://127.0.0.1:{port}/health") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.1)  # a poll interval under a deadline
            body = {"prompt": "x", "stream": True}
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                assert resp.status == 200
                assert await resp.read() == SSE
        proxy.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proxy.wait, DEADLINE) == 0
        assert b"tok" not in proxy.stdout.read().replace(b"token", b"")
    finally:
        if proxy.poll() is None:
            proxy.kill()
            proxy.wait()
