"""A tiny OpenAI-compatible streaming server for the bench tests, run on its own thread and loop."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from dataclasses import dataclass, field

from aiohttp import web

BYTES_PER_REQUEST = {"prefill-a": 60, "prefill-b": 40}   # what /metrics adds per successful stream


@dataclass
class FakeServerState:
    """Mutated only on the server's loop; read by the test after the run."""

    received: int = 0
    completed: int = 0
    bodies: list[dict] = field(default_factory=list)


class FakeOpenAIServer:
    """POST /v1/completions and /v1/chat/completions stream `max_tokens` one-character chunks, then a
    usage chunk (cached_tokens = prompt_tokens // 2) and [DONE]. The request with ordinal k (0-based,
    in arrival order) fails with HTTP 500 when k is in `fail_ordinals`, and with an error event after
    two tokens when k is in `midstream_fail_ordinals`. Token ids >= vocab_size get a 400."""

    def __init__(self, *, model: str = "fake-model", vocab_size: int = 100,
                 fail_ordinals: frozenset[int] = frozenset(),
                 midstream_fail_ordinals: frozenset[int] = frozenset()) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.fail_ordinals = fail_ordinals
        self.midstream_fail_ordinals = midstream_fail_ordinals
        self.state = FakeServerState()
        self.base_url = ""
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._completions)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "owned_by": "test", "vocab_size": self.vocab_size}
        return web.json_response({"object": "list", "data": [card]})

    async def _metrics(self, request: web.Request) -> web.Response:
        lines = ["# HELP hybridpd:kv_bytes_read_total KV bytes read", "# TYPE hybridpd:kv_bytes_read_total counter"]
        for peer, per_request in BYTES_PER_REQUEST.items():
            lines.append(f'hybridpd:kv_bytes_read_total{{peer="{peer}"}} {float(per_request * self.state.completed)}')
            lines.append(f'hybridpd:kv_bytes_read_created{{peer="{peer}"}} 1.7e9')
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    @staticmethod
    def _error(status: int, message: str) -> web.Response:
        return web.json_response({"error": {"message": message, "type": "test", "code": status}}, status=status)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        ordinal = self.state.received
        self.state.received += 1
        body = await request.json()
        self.state.bodies.append(body)
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if isinstance(prompt, list) and any(t >= self.vocab_size for t in prompt):
            return self._error(400, f"token id out of range (vocab {self.vocab_size})")
        if ordinal in self.fail_ordinals:
            return self._error(500, f"injected failure of request {ordinal}")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(payload: object) -> None:
            await response.write(f"data: {json.dumps(payload)}\n\n".encode())

        if chat:
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        max_tokens = body["max_tokens"]
        for k in range(max_tokens):
            if ordinal in self.midstream_fail_ordinals and k == 2:
                await send({"error": {"message": f"injected mid-stream failure of request {ordinal}", "code": 500}})
                await response.write_eof()
                return response
            finish = "length" if k == max_tokens - 1 else None
            choice = {"index": 0, "delta": {"content": "a"}} if chat else {"index": 0, "text": "a"}
            await send({"choices": [choice | {"finish_reason": finish}]})
        prompt_tokens = len(prompt)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                 "total_tokens": prompt_tokens + max_tokens,
                 "prompt_tokens_details": {"cached_tokens": prompt_tokens // 2}}
        await send({"choices": [], "usage": usage})
        self.state.completed += 1
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def start(self) -> FakeOpenAIServer:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        started = threading.Event()
        errors: list[BaseException] = []

        async def open_site() -> None:
            self._runner = web.AppRunner(self._app())
            await self._runner.setup()
            await web.SockSite(self._runner, sock).start()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(open_site())
            except BaseException as exc:  # handed to the starting thread
                errors.append(exc)
                started.set()
                return
            started.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=serve, name="fake-openai-server", daemon=True)
        self._thread.start()
        if not started.wait(timeout=30) or errors:
            raise RuntimeError(f"fake server did not start: {errors}")
        return self

    def stop(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
