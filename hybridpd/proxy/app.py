"""The proxy's aiohttp app: each generation request is a prefill call, then a decode call.

A request's path through the proxy:
  RECEIVED -> PREFILLING (one node; on failure, once more on another node if there is one)
           -> DECODING (one node; its bytes go to the client as they come) -> DONE
  A streaming client gets the prefill call's own events (the first token: proxy/prefill_stream.py) as soon as
  that call answers, then the decode node's, which continue the same stream; once those first events are out, a
  decode failure (a 4xx included) becomes an error event in the stream.
  A 4xx from a node goes back to the client as it is; any other node failure becomes a 502
  (504 on a timeout), or an error event when the stream to the client had already started. A decode node that
  could not even be connected to (nothing reached it) is replaced once by another decode node.
  When no prefill node can take the request (none known, or the prefill hop failed after its retry) and
  `--fallback-colocated` is on (the default), the decode node gets the original body without kv_transfer_params
  and prefills it itself: PREFILLING -> DECODING(colocated), counted in hybridpd_proxy_fallback_colocated_total.
  A client that goes away cancels the handler (`handler_cancellation=True`), which closes the
  upstream connection in flight, so the node aborts the request and frees its blocks.
A body asking for `n` > 1 samples goes through as one such request per sample (proxy/samples.py), its answers merged.
With `--routing cache_aware` the prompt is tokenized first (RECEIVED -> TOKENIZED) and each hop's node is chosen by
proxy/cache_aware.py from the nodes' KV events (proxy/kv_feed.py); each hit it predicted is compared with the
node's report (X-HybridPD-Cached-Tokens) in the metrics. With `--pd-threshold` a request whose chosen decode node
would compute fewer prompt tokens than the threshold skips PREFILLING: TOKENIZED -> DECODING(whole on that node),
counted in hybridpd_proxy_decode_alone_total.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from hybridpd import __version__
from hybridpd.api_keys import REFUSAL, ApiKeys
from hybridpd.cors import install as install_cors
from hybridpd.proxy.bodies import decode_body, prefill_body, sample_bodies, served_whole, wants_stream
from hybridpd.proxy.cache_aware import (
    Choice, cache_salt, choose, choose_decode_alone, token_ids_in_body, tokenize_body, truncated,
)
from hybridpd.proxy.config import ProxyConfig, Role, RoutingPolicy, Upstream
from hybridpd.proxy.errors import UpstreamError, UpstreamRejectedError
from hybridpd.proxy.health import check_all, health_body
from hybridpd.proxy.metrics import ProxyMetrics
from hybridpd.proxy.replies import ClientReply, Reply, sse_headers
from hybridpd.proxy.samples import merge_samples
from hybridpd.proxy.responses import (
    EventCount, error_response, invalid_request, no_upstream, relay_error_event, sse_error_event, sse_rejected_event,
    upstream_failed, upstream_rejected,
)
from hybridpd.proxy.discovery import DnsDiscovery, DnsResolver, refresh_all
from hybridpd.proxy.health_watch import probe_all
from hybridpd.proxy.outliers import OutlierDetector
from hybridpd.proxy.kv_feed import KVFeeds
from hybridpd.proxy.kv_index import PromptHashes
from hybridpd.proxy.nodes_file import NodesFile
from hybridpd.proxy.periodic import FirstRun, periodic_context
from hybridpd.proxy.routing import NoUpstreamError, Router
from hybridpd.proxy.upstream import DecodeStream, HeldLease, PrefillAnswer, UpstreamClient, first_byte_trace
from hybridpd.message_bodies import COUNT_TOKENS_PATH, MESSAGES_PATH
from hybridpd.response_bodies import RESPONSES_PATH
from hybridpd.tracing import Carrier, Span, carrier_of, start_tracing

logger = logging.getLogger(__name__)

_MAX_PREFILL_ATTEMPTS = 2  # the first node, then one retry on another
_KEPT_ALIVE = ("/v1/completions", "/v1/chat/completions")   # as vLLM's flag: its typed event streams send none
_FEEDS_INTERVAL_S = 1.0  # how often the KV event feeds follow the node list (and each checks its node)


class Proxy:
    """The handlers and the state they share: config, routers, metrics and the one ClientSession."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.metrics = ProxyMetrics()
        self.routers = {
            role: Router(nodes, config.routing, role.value, OutlierDetector(config.outliers))
            for role, nodes in ((Role.PREFILL, config.prefillers), (Role.DECODE, config.decoders))
        }
        resolver = DnsResolver(config.dns_server, timeout=config.connect_timeout)
        self.discoveries = tuple(DnsDiscovery(source, self.routers[source.role], resolver)
                                 for source in config.dns_sources)
        if config.nodes_file is not None:
            self.discoveries += (NodesFile(config.nodes_file, self.routers),)
        self._client: UpstreamClient | None = None
        self.feeds: KVFeeds | None = None
        self._releases: set[asyncio.Task] = set()
        self.tracer = start_tracing("hybridpd-proxy", config.otlp_traces_endpoint)

    @property
    def cache_aware(self) -> bool:
        return self.config.routing is RoutingPolicy.CACHE_AWARE

    def all_upstreams(self) -> tuple[Upstream, ...]:
        return self.routers[Role.PREFILL].upstreams + self.routers[Role.DECODE].upstreams

    async def follow_nodes(self) -> None:
        """The KV event feeds follow the routers' node lists (cache_aware only)."""
        if self.feeds is not None:
            self.feeds.reconcile(self.all_upstreams())

    @property
    def client(self) -> UpstreamClient:
        if self._client is None:
            raise RuntimeError("the proxy's client session is not open (the app is not running)")
        return self._client

    async def client_session(self, app: web.Application) -> AsyncIterator[None]:
        """cleanup_ctx: the one ClientSession for every upstream call, closed on shutdown."""
        tls = self.config.tls
        # nodes do their own admission; don't queue here
        connector = aiohttp.TCPConnector(limit=0, ssl=tls.client_context() if tls is not None else True)
        async with aiohttp.ClientSession(connector=connector, trace_configs=[first_byte_trace()]) as session:
            self._client = UpstreamClient(session, self.config, self.metrics)
            if self.cache_aware:
                self.feeds = KVFeeds(session, self.config.base_url, check_interval=_FEEDS_INTERVAL_S,
                                     timeout=self.config.health_timeout)
            try:
                yield
            finally:
                if self._releases:   # lease releases still under way get their short chance
                    await asyncio.wait(self._releases, timeout=self.config.health_timeout)
                if self.feeds is not None:
                    await self.feeds.close()
                    self.feeds = None
                self._client = None
                await asyncio.to_thread(self.tracer.shutdown)   # the spans still batched go out

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "/v1/chat/completions")

    async def invocations(self, request: web.Request) -> web.StreamResponse:
        """SageMaker's `POST /invocations`, as vLLM serves it: routed as the chat body (with `messages`) or the
        completions body (with `prompt`) it is."""
        try:
            body = await request.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and "messages" in body:
            return await self._generate(request, "/v1/chat/completions")
        if isinstance(body, dict) and "prompt" in body:
            return await self._generate(request, "/v1/completions")
        if not isinstance(body, dict):   # not a JSON object: the route's own 400 says so
            return await self._generate(request, "/v1/completions")
        return invalid_request("Cannot find suitable handler for request. Expected one of: a chat completions body "
                               "(with messages) or a completions body (with prompt)",
                               request.headers.get("X-Request-Id") or uuid.uuid4().hex, request.path)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, RESPONSES_PATH)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, MESSAGES_PATH)

    async def _generate(self, request: web.Request, path: str) -> web.StreamResponse:
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        with self.tracer.span("proxy request", carrier_of(request.headers),
                              {"gen_ai.request.id": request_id, "http.route": path}) as span:
            response = await self._answer(request, path, request_id, span)
            span.set({"http.response.status_code": response.status})
        self.metrics.count_request(path, response.status)
        return response

    async def _answer(self, request: web.Request, path: str, request_id: str, span: Span) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError as exc:
            return invalid_request(f"request body is not valid JSON: {exc}", request_id, path)
        if not isinstance(body, dict):
            return invalid_request("request body must be a JSON object", request_id, path)
        with self.tracer.span("routing", span.carrier(), {"hybridpd.routing": self.config.routing.value}):
            prompt = await self._prompt(path, body) if self.cache_aware else None
        bodies = [body] if served_whole(body) else sample_bodies(body)   # served whole: the node draws its samples
        if len(bodies) > 1:
            return await merge_samples(
                request, bodies, request_id,
                lambda reply, one, one_id: self._route(reply, path, one, one_id, prompt, span))
        keep_alive = self.config.sse_keep_alive if wants_stream(body) and path in _KEPT_ALIVE else None
        return await self._route(ClientReply(request, keep_alive, request_id), path, body, request_id, prompt, span)

    async def _route(self, reply: Reply, path: str, body: dict[str, Any], request_id: str,
                     prompt: PromptHashes | None, span: Span) -> web.StreamResponse:
        """One request of one sample through the nodes: whole on one node, or a prefill call then a decode call."""
        try:
            if served_whole(body):
                with self.tracer.span("whole call", span.carrier()) as call:
                    return await self._whole(reply, path, body, request_id, prompt, call.carrier())
            alone = self._decode_alone(prompt)
            if alone is not None:   # the decode node holds nearly all of the prompt: no prefill call
                self.metrics.count_decode_alone()
                with self.tracer.span("decode call", span.carrier()) as call:
                    return await self._decode(reply, path, decode_body(body, None), request_id, prompt, None,
                                              call.carrier(), first=alone)
            with self.tracer.span("prefill call", span.carrier()) as call:
                answer = await reply.wait(self._prefill_or_fall_back(path, body, request_id, prompt, call.carrier()))
            kv_params = answer.kv_transfer_params if answer is not None else None
            lease = answer.lease if answer is not None else None
            with self.tracer.span("decode call", span.carrier()) as call:
                if answer is not None and answer.head and kv_params is not None:
                    return await self._decode_after_head(
                        reply, path, decode_body(body, kv_params, answer.stream_head), request_id, prompt,
                        answer.head, lease, call.carrier())
                return await self._decode(reply, path, decode_body(body, kv_params), request_id, prompt, lease,
                                          call.carrier())
        except UpstreamRejectedError as exc:
            if reply.started:   # keep-alive comments went out with status 200
                return await self._end_started(reply, sse_rejected_event(exc))
            return upstream_rejected(exc, request_id)
        except NoUpstreamError as exc:
            if reply.started:
                return await self._end_started(reply, sse_error_event(exc))
            return no_upstream(str(exc), request_id, path)
        except UpstreamError as exc:
            logger.warning("request %s: %s", request_id, exc)
            if reply.started:
                return await self._end_started(reply, sse_error_event(exc))
            return upstream_failed(exc, request_id, path)

    @staticmethod
    async def _end_started(reply: Reply, event: bytes) -> web.StreamResponse:
        """A stream that keep-alive comments started, ended by the failure's error event."""
        with contextlib.suppress(ConnectionResetError):
            await reply.write(event)
        return await reply.close()

    async def _prompt(self, path: str, body: dict[str, Any]) -> PromptHashes | None:
        """The request's prompt, hashed as the nodes hash it; None when it cannot be known (then no prediction)."""
        tokens = token_ids_in_body(path, body)
        if tokens is None:
            tokenize = tokenize_body(path, body)
            router = self.routers[Role.DECODE]
            if tokenize is None or not router.upstreams:
                return None
            upstream = router.pick()
            tokens = await self.client.tokenize(upstream, tokenize)
            joined = tokenize_body(path, body, merge_inline_system=True) if path == MESSAGES_PATH else None
            if tokens is None and joined is not None and joined != tokenize:
                # A chat template that wants the system prompt first refused it: the node joins a Messages body's
                # system messages into the first for such a template (server/message_request.py), so ask for that.
                tokens = await self.client.tokenize(upstream, joined)
        tokens = truncated(body, tokens) if tokens else tokens
        return PromptHashes(tokens, cache_salt(body)) if tokens else None

    def _choose(self, role: Role, prompt: PromptHashes | None, exclude: tuple[Upstream, ...] = ()) -> Choice:
        router = self.routers[role]
        if prompt is None or self.feeds is None:
            return Choice(upstream=router.pick(exclude=exclude), predicted_hit=None, work_tokens=0)
        return choose(router, role, prompt, self.feeds.index, self.config.cost_rule, exclude)

    def _decode_alone(self, prompt: PromptHashes | None) -> Choice | None:
        """The decode node that serves the request whole by `--pd-threshold` (proxy/cache_aware.py), or None."""
        if prompt is None or self.feeds is None:
            return None
        try:
            return choose_decode_alone(self.routers[Role.DECODE], prompt, self.feeds.index, self.config.cost_rule)
        except NoUpstreamError:
            return None   # the decode call after the prefill says so

    def _compare(self, choice: Choice, reported: int | None) -> None:
        if choice.predicted_hit is not None and reported is not None:
            self.metrics.count_prediction(choice.upstream, choice.predicted_hit, reported)

    async def _prefill_or_fall_back(self, path: str, body: dict[str, Any], request_id: str,
                                    prompt: PromptHashes | None, trace: Carrier) -> PrefillAnswer | None:
        """The prefill node's answer; None (the decode node prefills) when no prefill node could take the request
        and the colocated fallback is on. A 4xx (the client's own error) is never retried elsewhere."""
        try:
            return await self._prefill(path, body, request_id, prompt, trace)
        except (UpstreamError, NoUpstreamError) as exc:
            if not self.config.fallback_colocated:
                raise
            logger.warning("request %s: %s; the decode node prefills it itself (fallback)", request_id, exc)
            self.metrics.count_fallback()
            return None

    async def _prefill(self, path: str, body: dict[str, Any], request_id: str,
                       prompt: PromptHashes | None, trace: Carrier) -> PrefillAnswer:
        router = self.routers[Role.PREFILL]
        attempts = min(_MAX_PREFILL_ATTEMPTS, len(router.upstreams))
        failed: list[UpstreamError] = []
        while True:
            choice = self._choose(Role.PREFILL, prompt, tuple(error.upstream for error in failed))
            upstream = choice.upstream
            try:
                answer = await self.client.prefill(
                    router, upstream, path, prefill_body(body, self.config.first_token_from_prefill, path),
                    f"{request_id}-prefill", choice.work_tokens, trace,
                )
            except UpstreamError as exc:
                failed.append(exc)
                if len(failed) >= attempts:
                    raise _combined(failed) from exc
                logger.warning("request %s: %s; retrying on another prefill node", request_id, exc)
                continue
            self._compare(choice, answer.cached_tokens)
            if answer.kv_transfer_params is None:
                logger.warning("request %s: %s answered without kv_transfer_params; "
                               "the decode node computes the prompt itself", request_id, upstream.name)
            return answer

    async def _whole(self, reply: Reply, path: str, body: dict[str, Any], request_id: str,
                     prompt: PromptHashes | None, trace: Carrier) -> web.StreamResponse:
        """A request that scores its prompt or holds several, served whole by a prefill node (the decode nodes keep
        to decoding); by a decode node when no prefill node could even be reached and the colocated fallback is on."""
        whole = decode_body(body, None)
        try:
            return await self._decode(reply, path, whole, request_id, prompt, None, trace, Role.PREFILL)
        except (UpstreamError, NoUpstreamError) as exc:
            if not self.config.fallback_colocated or (isinstance(exc, UpstreamError) and not exc.nothing_sent):
                raise
            logger.warning("request %s: %s; a decode node serves it (fallback)", request_id, exc)
            self.metrics.count_fallback()
        return await self._decode(reply, path, whole, request_id, prompt, None, trace, Role.DECODE)

    async def _decode(
        self, reply: Reply, path: str, body: dict[str, Any], request_id: str, prompt: PromptHashes | None,
        lease: HeldLease | None, trace: Carrier, role: Role = Role.DECODE, first: Choice | None = None,
    ) -> web.StreamResponse:
        async with contextlib.AsyncExitStack() as stack:
            stream = await self._open_decode(stack, path, body, request_id, prompt, first, lease, trace, role)
            headers = {"Content-Type": stream.content_type, "X-Request-Id": request_id}
            if not wants_stream(body):
                return web.Response(status=stream.status, body=await stream.read_all(), headers=headers)
            await reply.open(stream.status, headers)
            await self._relay(reply, stream, request_id, path)
            return await reply.close()

    async def _relay(self, out: Reply, stream: DecodeStream, request_id: str, path: str) -> None:
        """The decode node's bytes to the client as they come; a failure midway becomes the stream's error event."""
        relayed = EventCount()
        try:
            async for chunk in stream.chunks():
                await out.write(chunk)
                relayed.feed(chunk)
        except UpstreamError as exc:
            logger.warning("request %s: %s (after the stream started)", request_id, exc)
            await out.write(relay_error_event(path, exc, relayed.events))

    async def _decode_after_head(self, reply: Reply, path: str, body: dict[str, Any], request_id: str,
                                 prompt: PromptHashes | None, head: bytes,
                                 lease: HeldLease | None, trace: Carrier) -> web.StreamResponse:
        """A stream whose head (the first token) came with the prefill node's answer: the client has it before the
        decode call is even opened; the decode node's events follow. From here a failure is an error event."""
        try:
            first = self._choose(Role.DECODE, prompt)  # no decode node at all: a 503, before anything is sent
        except NoUpstreamError:
            self._release(lease)
            raise
        await reply.open(200, sse_headers(request_id))
        await reply.write(head)
        async with contextlib.AsyncExitStack() as stack:
            try:
                stream = await self._open_decode(stack, path, body, request_id, prompt, first, lease, trace)
            except UpstreamRejectedError as exc:
                logger.warning("request %s: %s refused the decode call: HTTP %d", request_id, exc.upstream.name,
                               exc.status)
                await reply.write(sse_rejected_event(exc))
            except (UpstreamError, NoUpstreamError) as exc:
                logger.warning("request %s: %s (after the stream started)", request_id, exc)
                await reply.write(sse_error_event(exc))
            else:
                await self._relay(reply, stream, request_id, path)
        return await reply.close()

    async def _open_decode(self, stack: contextlib.AsyncExitStack, path: str, body: dict[str, Any],
                           request_id: str, prompt: PromptHashes | None, first: Choice | None = None,
                           lease: HeldLease | None = None, trace: Carrier | None = None,
                           role: Role = Role.DECODE) -> DecodeStream:
        """The decode call (on `first` when given; on a node of `role`), opened on a second node if the first could
        not be connected to. When no decode node takes it, the prefill node's lease is released at once (it would
        pin blocks until it expired)."""
        try:
            return await self._open_decode_on(stack, path, body, request_id, prompt, first, trace or {}, role)
        except (UpstreamError, UpstreamRejectedError, NoUpstreamError):
            self._release(lease)
            raise

    def _release(self, lease: HeldLease | None) -> None:
        if lease is None:
            return
        task = asyncio.create_task(self.client.release_lease(lease))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _open_decode_on(self, stack: contextlib.AsyncExitStack, path: str, body: dict[str, Any],
                              request_id: str, prompt: PromptHashes | None, first: Choice | None,
                              trace: Carrier, role: Role) -> DecodeStream:
        router = self.routers[role]
        tried: list[Upstream] = []
        while True:
            choice = first if first is not None and not tried else self._choose(role, prompt, tuple(tried))
            try:
                stream = await stack.enter_async_context(
                    self.client.decode(router, choice.upstream, path, body, request_id, choice.work_tokens, trace))
            except UpstreamError as exc:
                tried.append(choice.upstream)
                if not exc.nothing_sent or len(tried) >= min(2, len(router.upstreams)):
                    raise
                logger.warning("request %s: %s; trying another decode node", request_id, exc)
                continue
            self._compare(choice, stream.cached_tokens)
            return stream

    async def forward(self, request: web.Request) -> web.StreamResponse:
        """A call that needs no prefill and no decode (`/v1/models`, the tokenizer's endpoints), answered by a decode
        node as it answers it."""
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        router = self.routers[Role.DECODE]
        try:
            upstream = router.pick()
        except NoUpstreamError as exc:
            return no_upstream(str(exc), request_id, request.path)
        body = await request.read() if request.method == "POST" else None
        try:
            status, data, content_type = await self.client.call(router, upstream, request.method, request.path, body)
        except UpstreamError as exc:
            return upstream_failed(exc, request_id, request.path)
        return web.Response(status=status, body=data, headers={"Content-Type": content_type})

    async def version(self, request: web.Request) -> web.Response:
        """vLLM's `GET /version`: this proxy's version."""
        return web.json_response({"version": __version__})

    async def health(self, request: web.Request) -> web.StreamResponse:
        current = self.routers[Role.PREFILL].upstreams + self.routers[Role.DECODE].upstreams
        status, body = health_body(await check_all(self.client, current),
                                   {u: self.routers[u.role].outliers.health(u) for u in current})
        return web.json_response(body, status=status)

    async def prometheus(self, request: web.Request) -> web.StreamResponse:
        self.metrics.retain({u.address for u in self.all_upstreams()})
        for router in self.routers.values():
            self.metrics.set_node_states(router.upstreams, router.outliers)
        for feed in self.feeds.feeds() if self.feeds is not None else ():
            host, port = feed.address
            self.metrics.set_index(f"{host}:{port}", feed.index.num_hashes if feed.index else None, feed.batches)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def _combined(failed: list[UpstreamError]) -> UpstreamError:
    """The last failure, its message also naming the nodes tried before it."""
    last = failed[-1]
    if len(failed) == 1:
        return last
    before = "; ".join(str(error) for error in failed[:-1])
    return UpstreamError(last.upstream, last.kind, f"{last.reason} (tried before: {before})")


PROXY_KEY = web.AppKey("proxy", Proxy)


def api_key_middleware(keys: ApiKeys) -> Any:
    """A guarded route without one of the keys: 401, in the route's error shape."""
    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if keys.refuses(request.method, request.path, request.headers):
            return error_response(401, REFUSAL, "authentication_error",
                                  request.headers.get("X-Request-Id") or uuid.uuid4().hex, request.path)
        return await handler(request)
    return check


def build_app(config: ProxyConfig) -> web.Application:
    """The app factory. Run it with `handler_cancellation=True` so a client that leaves cancels its calls."""
    proxy = Proxy(config)
    app = web.Application(middlewares=[api_key_middleware(config.api_keys)])
    install_cors(app, config.cors)
    app[PROXY_KEY] = proxy
    app.cleanup_ctx.append(proxy.client_session)
    app.cleanup_ctx.append(periodic_context("node discovery", lambda: refresh_all(proxy.discoveries),
                                            config.dns_interval, FirstRun.BEFORE_SERVING))
    app.cleanup_ctx.append(periodic_context("health probes", lambda: probe_all(tuple(proxy.routers.values()),
                                                                               proxy.client),
                                            config.probe_interval, FirstRun.AFTER_INTERVAL))
    app.cleanup_ctx.append(periodic_context("KV event feeds", proxy.follow_nodes, _FEEDS_INTERVAL_S, FirstRun.AT_START))
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.chat_completions)
    app.router.add_post(RESPONSES_PATH, proxy.responses)
    app.router.add_get(RESPONSES_PATH + "/{response_id}", proxy.forward)     # no response is stored: the node's 404
    app.router.add_post(RESPONSES_PATH + "/{response_id}/cancel", proxy.forward)
    app.router.add_post(MESSAGES_PATH, proxy.messages)
    app.router.add_post(COUNT_TOKENS_PATH, proxy.forward)
    app.router.add_get("/v1/models", proxy.forward)
    app.router.add_post("/tokenize", proxy.forward)
    app.router.add_post("/detokenize", proxy.forward)
    app.router.add_get("/tokenizer_info", proxy.forward)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/ping", proxy.health)     # vLLM's (SageMaker's) name for it
    app.router.add_post("/ping", proxy.health)
    app.router.add_get("/version", proxy.version)
    app.router.add_post("/invocations", proxy.invocations)
    app.router.add_get("/metrics", proxy.prometheus)
    return app
