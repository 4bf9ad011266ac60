"""A fake node for proxy tests: records what it receives and answers by a chosen behaviour."""

from __future__ import annotations

import asyncio
import enum
import json
import socket
from dataclasses import dataclass
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web


class Behavior(enum.Enum):
    OK = "ok"
    REJECT = "reject"              # 400 with an OpenAI error body
    FAIL = "fail"                  # 500
    HANG = "hang"                  # never answers (records its cancellation)
    HANG_MID_STREAM = "hang_mid"   # decode: sends the first SSE chunk, then never another
    NO_PARAMS = "no_params"        # prefill: answers 200 without kv_transfer_params
    STREAM_ERROR = "stream_error"  # prefill, streamed: 200, then an error event instead of the token
    SILENT = "silent"              # a stopped process: the kernel accepts connections, nothing ever answers


@dataclass(frozen=True, kw_only=True)
class Received:
    path: str
    body: dict[str, Any]
    headers: Mapping[str, str]  # case-insensitive


SSE_CHUNKS = (
    b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"Hel"}]}\n\n',
    b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"lo"}]}\n\n',
    b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"!","finish_reason":"length"}]}\n\n',
    b'data: [DONE]\n\n',
)
USAGE_CHUNK = b'data: {"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}\n\n'


def decode_answer(port: int, body: dict[str, Any]) -> dict[str, Any]:
    """A decode node's whole answer: which node served it, and a choice naming the seed it drew with."""
    return {"id": "cmpl-d", "node": port, "choices": [{"index": 0, "text": f"seed={body.get('seed')}"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
REJECT_BODY = b'{"error": {"message": "max_tokens must be >= 1", "type": "invalid_request_error", "code": 400}}'


PREFILL_STREAM_ID, PREFILL_STREAM_CREATED = "cmpl-p", 1700000000


def prefill_stream_chunks(path: str, params: dict[str, Any] | None, error: bool = False) -> list[bytes]:
    """What a node streams for a one-token prefill call: [the chat role chunk], the token's chunk (carrying the
    call's finish_reason and kv_transfer_params), [DONE]; or an error event in place of the token."""
    head = {"id": PREFILL_STREAM_ID, "created": PREFILL_STREAM_CREATED, "model": "tiny"}
    chunks = []
    if path.endswith("/chat/completions"):
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        chunks.append({**head, "object": "chat.completion.chunk", "choices": [role]})
        token = {"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": "length"}
        chunks.append({**head, "object": "chat.completion.chunk", "choices": [token]})
    else:
        token = {"index": 0, "text": "x", "logprobs": None, "finish_reason": "length", "stop_reason": None}
        chunks.append({**head, "object": "text_completion", "choices": [token]})
    if params is not None:
        chunks[-1]["kv_transfer_params"] = params
    if error:
        chunks[-1] = {"error": {"message": "engine exploded", "type": "internal_server_error", "code": 500}}
    return [b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in chunks] + [b"data: [DONE]\n\n"]


def remote_params(port: int) -> dict[str, Any]:
    return {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": f"engine-{port}",
        "remote_request_id": "req-7",
        "remote_block_ids": [[1, 2, 3], [4], [5]],
        "remote_host": "127.0.0.1",
        "remote_port": port + 1000,
        "remote_num_tokens": 41,
        "remote_lease_expiry": 1234.5,
        "remote_lease_secret": f"secret-{port}",
    }


def closed_port() -> int:
    """A port nobody listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SilentNode:
    """A listening socket nobody accepts from: connections open (the kernel's backlog), no byte ever comes back, as
    from a SIGSTOPped node."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        self._sock = socket.socket()
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._sock.bind((host, port))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]

    async def stop(self) -> None:
        self._sock.close()


class FakeNode:
    def __init__(self, behavior: Behavior = Behavior.OK, health_status: int = 200) -> None:
        self.behavior = behavior
        self.health_status = health_status
        self.received: list[Received] = []
        self.releases: list[dict[str, Any]] = []   # POST /kv_leases/release bodies
        self.arrived = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.hold: asyncio.Event | None = None             # when set here: a call waits for it before its answer
        self.hold_mid_event: asyncio.Event | None = None   # a decode stream waits for it halfway into its first event
        self.hold_after_event: asyncio.Event | None = None   # ... or after its first event
        self.tokenizer: Callable[[dict[str, Any]], tuple[int, dict[str, Any]]] | None = None   # /tokenize's answer
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/responses", self._generate)
        app.router.add_post("/v1/messages", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/detokenize", self._echo)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/health", self._health)
        app.router.add_post("/kv_leases/release", self._release)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _hang(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(Received(path=request.path, body=body, headers=request.headers.copy()))
        self.arrived.set()
        if self.behavior is Behavior.HANG:
            await self._hang()
        if self.hold is not None:
            await self.hold.wait()
        if self.behavior is Behavior.REJECT:
            return web.Response(status=400, body=REJECT_BODY, content_type="application/json")
        if self.behavior is Behavior.FAIL:
            return web.Response(status=500, text="engine exploded")
        is_prefill = (body.get("kv_transfer_params") or {}).get("do_remote_decode") is True
        if is_prefill and body.get("stream"):
            return await self._prefill_stream(request)
        if is_prefill:
            answer: dict[str, Any] = {"id": "cmpl-p", "choices": [{"index": 0, "text": "x"}]}
            if self.behavior is not Behavior.NO_PARAMS:
                answer["kv_transfer_params"] = remote_params(self.port)
            return web.json_response(answer)
        if not body.get("stream"):
            return web.json_response(decode_answer(self.port, body))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        usage = (body.get("stream_options") or {}).get("include_usage") is True
        chunks = SSE_CHUNKS[:-1] + ((USAGE_CHUNK,) if usage else ()) + SSE_CHUNKS[-1:]
        for index, chunk in enumerate(chunks):
            if index == 0 and self.hold_mid_event is not None:
                await out.write(chunk[:10])
                await self.hold_mid_event.wait()
                chunk = chunk[10:]
            await out.write(chunk)
            if index == 0 and self.hold_after_event is not None:
                await self.hold_after_event.wait()
            if self.behavior is Behavior.HANG_MID_STREAM and index == 0:
                await self._hang()
        await out.write_eof()
        return out

    async def _prefill_stream(self, request: web.Request) -> web.StreamResponse:
        """A streamed one-token prefill call, shaped as a node streams it (server/streaming.py)."""
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for chunk in prefill_stream_chunks(request.path, None if self.behavior is Behavior.NO_PARAMS
                                           else remote_params(self.port), self.behavior is Behavior.STREAM_ERROR):
            await out.write(chunk)
        await out.write_eof()
        return out

    async def _release(self, request: web.Request) -> web.Response:
        self.releases.append(await request.json())
        return web.json_response({"status": "accepted"}, status=202)

    async def _tokenize(self, request: web.Request) -> web.Response:
        if self.tokenizer is None:
            return await self._echo(request)
        body = await request.json()
        self.received.append(Received(path=request.path, body=body, headers=request.headers.copy()))
        status, answer = self.tokenizer(body)
        return web.json_response(answer, status=status)

    async def _echo(self, request: web.Request) -> web.Response:
        """A tokenizer endpoint's stand-in: the body it got, and which node it is."""
        return web.json_response({"got": await request.json(), "path": request.path, "node": self.port})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "node": self.port}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status, text="ok" if self.health_status == 200 else "starting")
