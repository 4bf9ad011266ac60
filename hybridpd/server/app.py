"""The node's aiohttp app: OpenAI-compatible routes over an `EngineClient`.

One request through `/v1/completions` (or chat):
  admit (503 while draining) -> read the JSON object -> check the cluster token if it carries kv_transfer_params
  -> parse into an EngineRequest (400 on any bad field) -> engine.generate(): the first output decides the
  status (the engine rejects input before its first yield; a request that fails before any output is an
  HTTP error) -> one JSON answer, or an SSE stream -> always close the engine generator, so a request whose
  client went away is aborted and its blocks freed.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from hybridpd import __version__
from hybridpd.api_keys import REFUSAL, ApiKeys
from hybridpd.cors import install as install_cors
from hybridpd.engine.request import RequestOutput
from hybridpd.engine.transfer_params import RemotePrefillParams
from hybridpd.errors import ForbiddenError, HybridPDError, NotFoundError, UnauthorizedError
from hybridpd.message_bodies import COUNT_TOKENS_PATH, MESSAGES_PATH
from hybridpd.response_bodies import RESPONSES_PATH
from hybridpd.server.admission import Admission
from hybridpd.server.body import read_json_object
from hybridpd.server.config import ServerConfig
from hybridpd.server.engine_client import EngineClient
from hybridpd.server.errors import error_middleware
from hybridpd.server.metrics import RequestTracker, ServerMetrics, metrics_middleware
from hybridpd.server.choice_streams import stream_choices
from hybridpd.server.protocol import (
    Endpoint, ParsedRequest, invoked_endpoint, parse_choices, parse_detokenize_request, parse_tokenize_request,
)
from hybridpd.server.message_objects import MessageEvents, whole_message
from hybridpd.server.message_request import count_tokens, needs_system_first, parse_messages_request
from hybridpd.server.response_objects import ResponseEvents, whole_response
from hybridpd.server.response_request import ResponsesRequest, parse_responses_request
from hybridpd.server.event_stream import stream_events
from hybridpd.server.responses import (
    FinalOutput, choices_response, final_response, models_response, tokenize_response,
)
from hybridpd.server.outputs import EngineOutputs
from hybridpd.server.streaming import ChunkBuilder, SseStream, end_stream, failure, stream_outputs
from hybridpd.server.request_trace import record_request
from hybridpd.tracing import NoTracer, Span, Tracer, carrier_of
from hybridpd.wire_headers import CACHED_TOKENS_HEADER, CLUSTER_TOKEN_HEADER

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away before the answer"

ADMISSION_KEY = web.AppKey("admission", Admission)
METRICS_KEY = web.AppKey("server_metrics", ServerMetrics)
HEALTH_KEY = web.AppKey("health_handler", Callable[[web.Request], Awaitable[web.StreamResponse]])

EngineMetrics = Callable[[], Awaitable[bytes]]
# How one request is answered: its stream (from the first output on), or its whole answer's JSON object.
StreamAnswer = Callable[[RequestOutput, EngineOutputs, RequestTracker, dict[str, str], SseStream],
                        Awaitable[web.StreamResponse]]
WholeAnswer = Callable[[FinalOutput], dict[str, Any]]
Answers = tuple[StreamAnswer, WholeAnswer]
log = logging.getLogger(__name__)
_dumps = functools.partial(json.dumps, allow_nan=False)


def _client_gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


class Handlers:
    def __init__(self, engine: EngineClient, config: ServerConfig, registry: CollectorRegistry,
                 metrics: ServerMetrics, admission: Admission, engine_metrics: EngineMetrics | None,
                 tracer: Tracer) -> None:
        self._engine = engine
        self._tracer = tracer
        self._engine_metrics = engine_metrics
        self._config = config
        self._registry = registry
        self._metrics = metrics
        self._admission = admission
        self._created = int(time.time())
        self._system_first: bool | None = None   # the chat template's, probed at the first Messages request

    def _authorize(self, request: web.Request, body: dict[str, Any]) -> None:
        """Requests that steer KV transfers need the cluster token (when one is configured), compared in
        constant time."""
        if self._config.cluster_token is None or body.get("kv_transfer_params") is None:
            return
        # a header that is not UTF-8 arrives with surrogate escapes: it compares unequal, never raises
        sent = request.headers.get(CLUSTER_TOKEN_HEADER, "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(sent, self._config.cluster_token.encode("utf-8")):
            raise UnauthorizedError(f"kv_transfer_params need a valid {CLUSTER_TOKEN_HEADER} header")

    def _check_peer(self, parsed: ParsedRequest) -> None:
        """A remotely prefilled request may pull only from a trusted peer (`--kv-trusted-peers`): the blocks it pulls
        enter this node's prefix cache."""
        params = parsed.engine_request.kv_transfer
        if isinstance(params, RemotePrefillParams) and not self._config.trusted_peers.allows(params.remote_host):
            raise ForbiddenError(
                f"kv_transfer_params.remote_host {params.remote_host} is not a trusted peer of this node "
                f"(--kv-trusted-peers: {self._config.trusted_peers.describe()})"
            )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.CHAT)

    async def invocations(self, request: web.Request) -> web.StreamResponse:
        """SageMaker's `POST /invocations`, as vLLM serves it: a chat body (it has `messages`) or a completions body
        (it has `prompt`), answered as that route answers it."""
        return await self._generate(request, invoked_endpoint(await read_json_object(request)))

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API (`/v1/responses`), served as the chat request it asks for."""
        with self._admission.admit(), self._tracer.span("node request", carrier_of(request.headers)) as span:
            body = await read_json_object(request)
            self._authorize(request, body)
            asked = parse_responses_request(body, self._engine, self._config.model_names,
                                            self._config.tool_parsing, self._config.templating)
            return await self._serve(request, asked.parsed, span,
                                     lambda parsed: self._response_answers(replace(asked, parsed=parsed)))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API (`/v1/messages`), served as the chat request it asks for."""
        with self._admission.admit(), self._tracer.span("node request", carrier_of(request.headers)) as span:
            body = await read_json_object(request)
            self._authorize(request, body)
            parsed = parse_messages_request(body, self._engine, self._config.model_names,
                                            self._config.tool_parsing, self._config.templating,
                                            merge_inline_system=self._merges_inline_system())
            return await self._serve(request, parsed, span, self._message_answers)

    async def count_message_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's `/v1/messages/count_tokens`: the prompt's tokens (`context_management` as vLLM adds it)."""
        body = await read_json_object(request)
        count = count_tokens(body, self._engine, self._config.model_names, self._config.templating,
                             merge_inline_system=self._merges_inline_system())
        return web.json_response({"input_tokens": count, "context_management": {"original_input_tokens": count}})

    def _merges_inline_system(self) -> bool:
        """Whether Messages bodies join their system messages into the first (message_request.needs_system_first)."""
        if self._system_first is None:
            self._system_first = needs_system_first(self._engine.tokenizer)
            if self._system_first:
                log.warning("the chat template needs the system prompt first: system messages inside a /v1/messages "
                            "conversation are joined into the first (each new one changes the prompt's prefix)")
        return self._system_first

    async def stored_response(self, request: web.Request) -> web.Response:
        """`GET /v1/responses/{id}` and its `/cancel`: no response is stored here (vLLM keeps none either unless
        told to), so every id is unknown."""
        raise NotFoundError(f"Response with id '{request.match_info['response_id']:.80}' not found.")

    async def _generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        with self._admission.admit(), self._tracer.span("node request", carrier_of(request.headers)) as span:
            body = await read_json_object(request)
            self._authorize(request, body)
            requests = [self._server_defaults(parsed) for parsed in parse_choices(
                body, endpoint, self._engine, self._config.model_names, self._config.tool_parsing,
                self._config.templating)]
            if len(requests) > 1:
                return await self._choices(request, requests, span)
            return await self._serve(request, requests[0], span,
                                     self._completion_answers, keep_alive=True)

    def _server_defaults(self, parsed: ParsedRequest) -> ParsedRequest:
        """A chat or completions request with what vLLM's flags turn on for every request: the usage in every chunk
        and at a stream's end (`--enable-force-include-usage`), tokens named by id (`--return-tokens-as-token-ids`)."""
        if self._config.force_include_usage and parsed.stream:
            parsed = replace(parsed, include_usage=True, continuous_usage=True)
        if self._config.tokens_as_ids:
            parsed = replace(parsed, tokens_as_ids=True)
        return parsed

    async def _serve(self, request: web.Request, parsed: ParsedRequest, span: Span,
                     answers: Callable[[ParsedRequest], Answers], keep_alive: bool = False) -> web.StreamResponse:
        """One engine request, answered as `answers` shape it: the first output decides the status (a failure
        before it is an HTTP error), then a stream or one JSON answer; the engine generator always closed. With
        `keep_alive` (chat and completions, as vLLM's) and `--sse-keep-alive-interval`, a stream whose first output
        takes longer than the interval starts at 200 with keep-alive comments (a failure is then an error event)."""
        self._check_peer(parsed)
        tracker = self._metrics.tracker(keep_output=self._config.request_logging.outputs,
                                        max_tokens=parsed.engine_request.sampling.max_tokens)
        self._config.request_logging.inputs(parsed, self._engine.tokenizer)
        parsed = replace(parsed, engine_request=replace(parsed.engine_request,
                                                        trace_context=tuple(span.carrier().items())))
        stream, whole = answers(parsed)
        outputs = EngineOutputs(self._engine.generate(parsed.engine_request))
        sse = SseStream(request, self._config.sse_keep_alive if keep_alive and parsed.stream else None)
        try:
            try:
                first = await sse.wait(outputs.next())
            except Exception as exc:  # noqa: BLE001 - after keep-alive comments the status went out already
                if sse.response is None:
                    raise
                return await end_stream(sse.response, exc)
            error = failure(first)
            if error is not None:
                tracker.observe(first)
                if sse.response is None:
                    raise error
                return await end_stream(sse.response, error)
            headers = {CACHED_TOKENS_HEADER: str(first.num_cached_tokens)}
            if parsed.stream:
                return await stream(first, outputs, tracker, headers, sse)
            return await _answer(request, first, outputs, tracker, headers, whole)
        finally:
            await outputs.close()
            record_request(self._tracer, span, parsed, tracker)
            self._config.request_logging.outputs_of(parsed, tracker)

    def _completion_answers(self, parsed: ParsedRequest) -> Answers:
        """A completions or chat request's stream of chunks, or its answer object."""
        model, tokenizer = self._config.served_model_name, self._engine.tokenizer
        return (lambda first, rest, tracker, headers, sse: stream_outputs(
                    sse, parsed, first, rest, ChunkBuilder(parsed, model, tokenizer), tracker, headers),
                lambda final: final_response(parsed, final, model, tokenizer))

    def _response_answers(self, asked: ResponsesRequest) -> Answers:
        """A Responses request's stream of events, or its `response` object."""
        model, tokenizer = self._config.served_model_name, self._engine.tokenizer
        return (lambda first, rest, tracker, headers, sse: stream_events(
                    sse, first, rest, ResponseEvents(asked, model, tokenizer), tracker, headers),
                lambda final: whole_response(asked, final, model, tokenizer))

    def _message_answers(self, parsed: ParsedRequest) -> Answers:
        """A Messages request's stream of events, or its `message` object."""
        model = self._config.served_model_name
        return (lambda first, rest, tracker, headers, sse: stream_events(
                    sse, first, rest, MessageEvents(parsed, model, first), tracker, headers),
                lambda final: whole_message(parsed, final, model))

    async def _choices(self, request: web.Request, requests: list[ParsedRequest],
                       span: Span) -> web.StreamResponse:
        """A body of several choices (`n` > 1, several prompts): each its own engine request, all queued at once; one
        answer, or one stream. A failure of one ends the others (their generators closed: aborted, blocks freed)."""
        trackers = [self._metrics.tracker(keep_output=self._config.request_logging.outputs,
                                          max_tokens=p.engine_request.sampling.max_tokens, one_of_choices=True)
                    for p in requests]
        for parsed in requests:
            self._config.request_logging.inputs(parsed, self._engine.tokenizer)
        requests = [replace(p, engine_request=replace(p.engine_request, trace_context=tuple(span.carrier().items())))
                    for p in requests]
        outputs = [EngineOutputs(self._engine.generate(p.engine_request)) for p in requests]
        try:
            if requests[0].stream:
                builders = [ChunkBuilder(p, self._config.served_model_name, self._engine.tokenizer) for p in requests]
                sse = SseStream(request, self._config.sse_keep_alive)
                return await stream_choices(sse, requests, outputs, builders, trackers, {})
            return await self._choices_answer(request, requests, outputs, trackers)
        finally:
            for one in outputs:
                await one.close()
            for parsed, tracker in zip(requests, trackers):
                record_request(self._tracer, span, parsed, tracker)
                self._config.request_logging.outputs_of(parsed, tracker)
            self._observe_choices(requests, trackers)

    def _observe_choices(self, requests: list[ParsedRequest], trackers: list[RequestTracker]) -> None:
        """vLLM's per-prompt figures of a body with several choices: its `n`, and the most tokens one of a
        prompt's finished choices generated."""
        n = 1 + max(p.choice.sample for p in requests if p.choice is not None)
        by_prompt: dict[int, list[int]] = {}
        for parsed, tracker in zip(requests, trackers):
            prompt = parsed.choice.index // n if parsed.choice is not None else 0
            finished = [tracker.generated] if tracker.finish_reason is not None else []
            by_prompt.setdefault(prompt, []).extend(finished)
        for generated in by_prompt.values():
            self._metrics.observe_choices(n, generated)

    async def _choices_answer(self, request: web.Request, requests: list[ParsedRequest],
                              outputs: list[EngineOutputs], trackers: list[RequestTracker]) -> web.StreamResponse:
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(_collect(request, [], o, t)) for o, t in zip(outputs, trackers)]
        except BaseExceptionGroup as grouped:
            raise grouped.exceptions[0] from None
        finals = [task.result() for task in tasks]
        if any(final is None for final in finals):
            return web.Response(status=CLIENT_CLOSED_REQUEST)
        body = choices_response(requests, finals, self._config.served_model_name, self._engine.tokenizer)
        cached = sum(final.num_cached_tokens for parsed, final in zip(requests, finals) if parsed.counts_prompt)
        return web.json_response(body, dumps=_dumps, headers={CACHED_TOKENS_HEADER: str(cached)})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(models_response(self._engine, self._config.model_names, self._created))

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await read_json_object(request)
        asked = parse_tokenize_request(body, self._engine, self._config.model_names, self._config.templating)
        strings = self._engine.tokenizer.token_strings(asked.tokens) if asked.token_strs else None
        return web.json_response(tokenize_response(asked.tokens, strings, self._engine.max_model_len))

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await read_json_object(request)
        tokens = parse_detokenize_request(body, self._engine, self._config.model_names)
        return web.json_response({"prompt": self._engine.tokenizer.decode(tokens, skip_special_tokens=False)})

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        return web.json_response(self._engine.tokenizer.describe(), dumps=_dumps)

    async def health(self, request: web.Request) -> web.Response:
        if not self._admission.accepting:
            return web.json_response({"status": "draining"}, status=503)
        if not self._engine.healthy():
            return web.json_response({"status": "unhealthy", "reason": self._engine.health_detail()}, status=503)
        return web.json_response({"status": "ok"})

    async def version(self, request: web.Request) -> web.Response:
        """vLLM's `GET /version`: this server's version."""
        return web.json_response({"version": __version__})

    async def load(self, request: web.Request) -> web.Response:
        """vLLM's `GET /load`: the generation requests in flight (completions, chat, Responses, Messages) with
        `--enable-server-load-tracking`, else 0 (as vLLM answers without it)."""
        return web.json_response({"server_load": self._admission.in_flight if self._config.load_tracking else 0})

    async def metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self._registry)
        if self._engine_metrics is not None:
            try:
                body += await self._engine_metrics()
            except (HybridPDError, asyncio.TimeoutError) as exc:  # the engine's families are missing, ours are not
                log.warning("engine metrics unavailable: %s", exc)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _answer(request: web.Request, first: RequestOutput, outputs: EngineOutputs, tracker: RequestTracker,
                  headers: dict[str, str], build: Callable[[FinalOutput], dict[str, Any]]) -> web.StreamResponse:
    """One JSON answer, `build` from the request's outputs joined; 499 when the client went away meanwhile."""
    tracker.observe(first)
    final = await _collect(request, [first], outputs, tracker)
    if final is None:
        return web.Response(status=CLIENT_CLOSED_REQUEST)
    return web.json_response(build(final), dumps=_dumps, headers=headers)


async def _collect(request: web.Request, collected: list[RequestOutput], outputs: EngineOutputs,
                   tracker: RequestTracker) -> FinalOutput | None:
    """The request's outputs after `collected` up to the finished one, joined; None if the client went away."""
    while not collected or not collected[-1].finished:
        if collected and _client_gone(request):
            return None
        output = await outputs.next()
        tracker.observe(output)
        error = failure(output)
        if error is not None:
            raise error
        collected.append(output)
    return FinalOutput.join(collected)


async def expect_continue(request: web.Request) -> None:
    """`Expect: 100-continue` as aiohttp answers it, for a caller that may have left meanwhile: the proxy waits a few
    seconds for this first byte, so a front that was stopped and resumes finds callers gone. Their calls end here,
    quietly (aiohttp's own handler logs a traceback for each)."""
    if request.headers.get("Expect", "").lower() != "100-continue":
        raise web.HTTPExpectationFailed(text=f"Unknown Expect: {request.headers.get('Expect')}")
    if request.transport is None or request.transport.is_closing():
        raise web.HTTPRequestTimeout()
    try:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    except ConnectionResetError:
        raise web.HTTPRequestTimeout() from None
    request.writer.output_size = 0


def api_key_middleware(keys: ApiKeys) -> Any:
    """Refuses a guarded route without one of the keys (401, in the route's error shape: inside error_middleware)."""
    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if keys.refuses(request.method, request.path, request.headers):
            raise UnauthorizedError(REFUSAL)
        return await handler(request)
    return check


def probe_app(app: web.Application) -> web.Application:
    """A plain-HTTP app with `app`'s `/health` alone (`--health-port`): what a kubelet probes when the node's own
    listener requires client certificates (mutual TLS), which a probe cannot present. It tells nothing a peer could
    use: healthy or not, and why."""
    probes = web.Application()
    probes.add_routes([web.get("/health", app[HEALTH_KEY])])
    return probes


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """vLLM's `--enable-request-id-headers`: every answer carries the request's X-Request-Id, or a new one."""
    response.headers.setdefault("X-Request-Id", request.headers.get("X-Request-Id") or uuid.uuid4().hex)


def create_app(engine: EngineClient, config: ServerConfig, registry: CollectorRegistry,
               extra_routes: Iterable[web.AbstractRouteDef] = (),
               engine_metrics: EngineMetrics | None = None, tracer: Tracer | None = None) -> web.Application:
    """The app; `app[ADMISSION_KEY]` is its admission gate (close it to drain before shutdown). `/metrics` serves
    `registry` and, when given, the text `engine_metrics()` returns (an engine in another process).

    Run it with `web.AppRunner(app, handler_cancellation=True)` so that a non-streaming request whose client
    disconnects is aborted at once, not at its next output.
    """
    metrics = ServerMetrics(registry, config.served_model_name, engine.max_model_len)
    admission = Admission()
    app = web.Application(middlewares=[metrics_middleware(metrics), error_middleware,
                                       api_key_middleware(config.api_keys)],
                          client_max_size=config.client_max_size)
    app[ADMISSION_KEY] = admission
    app[METRICS_KEY] = metrics
    h = Handlers(engine, config, registry, metrics, admission, engine_metrics, tracer or NoTracer())
    app[HEALTH_KEY] = h.health
    app.add_routes([
        web.post("/v1/completions", h.completions, expect_handler=expect_continue),
        web.post("/v1/chat/completions", h.chat_completions, expect_handler=expect_continue),
        web.post(RESPONSES_PATH, h.responses, expect_handler=expect_continue),
        web.post(MESSAGES_PATH, h.messages, expect_handler=expect_continue),
        web.post(COUNT_TOKENS_PATH, h.count_message_tokens),
        web.get(RESPONSES_PATH + "/{response_id}", h.stored_response),
        web.post(RESPONSES_PATH + "/{response_id}/cancel", h.stored_response),
        web.get("/v1/models", h.models),
        web.post("/tokenize", h.tokenize),
        web.post("/detokenize", h.detokenize),
        web.get("/health", h.health),
        web.get("/ping", h.health),    # vLLM's (SageMaker's) name for it
        web.post("/ping", h.health),
        web.get("/version", h.version),
        web.post("/invocations", h.invocations, expect_handler=expect_continue),
        web.get("/load", h.load),
        web.get("/metrics", h.metrics),
    ])
    if config.request_id_headers:
        app.on_response_prepare.append(_add_request_id)
    install_cors(app, config.cors)
    if config.tokenizer_info_endpoint:   # off by default, as vLLM's: it shows the tokenizer's config and template
        app.add_routes([web.get("/tokenizer_info", h.tokenizer_info)])
    app.add_routes(list(extra_routes))
    return app
