"""Calls from the proxy to one node over the app's one shared ClientSession.

Every failure leaves as a typed error: `UpstreamRejectedError` for a 4xx (passes through to the client),
`UpstreamError` for everything else (a 5xx, no connection, a timeout, an unusable answer).
Every call is counted as outstanding on its router while it runs, and timed in the metrics.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from hybridpd.proxy.config import ProxyConfig, Upstream
from hybridpd.proxy.errors import FailureKind, UpstreamError, UpstreamRejectedError
from hybridpd.proxy.metrics import ProxyMetrics
from hybridpd.proxy.prefill_stream import SSE_CONTENT_TYPE, PrefillStreamError, read_prefill_stream
from hybridpd.proxy.routing import Router
from hybridpd.server.app import CACHED_TOKENS_HEADER, CLUSTER_TOKEN_HEADER
from hybridpd.server.stream_head import StreamHead

_ERROR_SNIPPET = 300  # characters of a node's 5xx body quoted in our 502


def _failure(upstream: Upstream, exc: BaseException) -> UpstreamError:
    """Classifies a transport-level exception; a connect timeout means the node is unreachable."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return UpstreamError(upstream, FailureKind.UNREACHABLE, "connect timed out")
    if isinstance(exc, aiohttp.ClientConnectorError) and not isinstance(exc, aiohttp.ClientSSLError):
        return UpstreamError(upstream, FailureKind.UNREACHABLE, f"{type(exc).__name__}: {exc}", nothing_sent=True)
    if isinstance(exc, TimeoutError):
        return UpstreamError(upstream, FailureKind.TIMEOUT, "no answer within the timeout")
    return UpstreamError(upstream, FailureKind.UNREACHABLE, f"{type(exc).__name__}: {exc}")


def _cached_tokens(response: aiohttp.ClientResponse) -> int | None:
    value = response.headers.get(CACHED_TOKENS_HEADER, "")
    return int(value) if value.isdigit() else None


@dataclass(frozen=True, kw_only=True)
class PrefillAnswer:
    kv_transfer_params: dict[str, Any] | None
    cached_tokens: int | None   # the prefill node's prefix hit, when it said
    # A streamed call's head of the client's stream and what the decode node continues (proxy/prefill_stream.py);
    # empty / None for a JSON answer.
    head: bytes = b""
    stream_head: StreamHead | None = None


class DecodeStream:
    """An open 2xx answer of a decode node: its status and content type, and its bytes as they come."""

    def __init__(self, upstream: Upstream, response: aiohttp.ClientResponse,
                 work_done: Callable[[], None] = lambda: None) -> None:
        self.upstream = upstream
        self.status = response.status
        self.content_type = response.headers.get("Content-Type", "application/json")
        self.cached_tokens = _cached_tokens(response)
        self._response = response
        self._work_done = work_done   # the prompt's work is over once the first bytes (the first token) arrive

    async def chunks(self) -> AsyncIterator[bytes]:
        first = True
        try:
            async for chunk in self._response.content.iter_any():
                if first:
                    self._work_done()
                    first = False
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _failure(self.upstream, exc) from exc

    async def read_all(self) -> bytes:
        try:
            return await self._response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _failure(self.upstream, exc) from exc


class UpstreamClient:
    def __init__(self, session: aiohttp.ClientSession, config: ProxyConfig, metrics: ProxyMetrics) -> None:
        self._session = session
        self._config = config
        self._metrics = metrics
        self._prefill_timeout = aiohttp.ClientTimeout(
            total=config.prefill_timeout, sock_connect=config.connect_timeout
        )
        self._decode_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout, sock_read=config.decode_timeout
        )
        self._health_timeout = aiohttp.ClientTimeout(
            total=config.health_timeout, sock_connect=min(config.connect_timeout, config.health_timeout)
        )

    def _headers(self, request_id: str, body: dict[str, Any]) -> dict[str, str]:
        """The node checks the cluster token only on calls that carry kv_transfer_params; only those get it."""
        headers = {"X-Request-Id": request_id}
        if self._config.cluster_token is not None and "kv_transfer_params" in body:
            headers[CLUSTER_TOKEN_HEADER] = self._config.cluster_token
        return headers

    @contextlib.asynccontextmanager
    async def _call(self, router: Router, upstream: Upstream,
                    work_tokens: int = 0) -> AsyncIterator[Callable[[], None]]:
        """Counts, times and tracks one call; records its failure kind if it raises. Yields what to call once the
        node has done the call's work (`Router.in_flight`)."""
        self._metrics.count_call(upstream)
        start = time.perf_counter()
        try:
            with router.in_flight(upstream, work_tokens) as work_done:
                self._metrics.set_outstanding(upstream, router.outstanding(upstream))
                yield work_done
        except UpstreamError as exc:
            self._metrics.count_error(upstream, exc.kind.value)
            if exc.kind is FailureKind.UNREACHABLE:
                router.mark_down(upstream)  # routed around until the health watch sees it answer again
            raise
        except UpstreamRejectedError:
            self._metrics.count_error(upstream, "rejected")
            raise
        finally:
            self._metrics.observe_latency(upstream, time.perf_counter() - start)
            self._metrics.set_outstanding(upstream, router.outstanding(upstream))

    async def _raise_for_status(self, upstream: Upstream, response: aiohttp.ClientResponse) -> None:
        if response.status < 400:
            return
        body = await response.read()
        if response.status < 500:
            raise UpstreamRejectedError(
                upstream, response.status, body, response.headers.get("Content-Type", "application/json")
            )
        snippet = body.decode("utf-8", "replace")[:_ERROR_SNIPPET]
        raise UpstreamError(upstream, FailureKind.SERVER_ERROR, f"HTTP {response.status}: {snippet}")

    async def prefill(
        self, router: Router, upstream: Upstream, path: str, body: dict[str, Any], request_id: str,
        work_tokens: int = 0,
    ) -> PrefillAnswer:
        """Runs the prefill call; returns the answer's top-level `kv_transfer_params` (None when absent) and, for a
        streamed call, the head of the client's stream."""
        async with self._call(router, upstream, work_tokens):
            try:
                async with self._session.post(
                    self._config.base_url(upstream) + path, json=body, headers=self._headers(request_id, body),
                    timeout=self._prefill_timeout,
                ) as response:
                    await self._raise_for_status(upstream, response)
                    raw = await response.read()
                    cached = _cached_tokens(response)
                    streamed = response.headers.get("Content-Type", "").startswith(SSE_CONTENT_TYPE)
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise _failure(upstream, exc) from exc
            if streamed:
                try:
                    stream = read_prefill_stream(raw)
                except PrefillStreamError as exc:
                    kind = FailureKind.SERVER_ERROR if exc.from_node else FailureKind.BAD_ANSWER
                    raise UpstreamError(upstream, kind, str(exc)) from exc
                return PrefillAnswer(kv_transfer_params=stream.kv_transfer_params, cached_tokens=cached,
                                     head=stream.head, stream_head=stream.stream_head)
            try:
                answer = json.loads(raw)
            except ValueError as exc:
                raise UpstreamError(upstream, FailureKind.BAD_ANSWER, "answer is not JSON") from exc
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            if params is not None and not isinstance(params, dict):
                raise UpstreamError(upstream, FailureKind.BAD_ANSWER, "kv_transfer_params is not an object")
            return PrefillAnswer(kv_transfer_params=params, cached_tokens=cached)

    @contextlib.asynccontextmanager
    async def decode(
        self, router: Router, upstream: Upstream, path: str, body: dict[str, Any], request_id: str,
        work_tokens: int = 0,
    ) -> AsyncIterator[DecodeStream]:
        """Opens the decode call; the connection closes (and the node sees it) when the block exits.

        Only opening the call is guarded here: an error raised by the block itself (the client went
        away while we wrote to it) is not the node's failure and passes through untouched.
        """
        async with self._call(router, upstream, work_tokens) as work_done, contextlib.AsyncExitStack() as stack:
            try:
                response = await stack.enter_async_context(self._session.post(
                    self._config.base_url(upstream) + path, json=body, headers=self._headers(request_id, body),
                    timeout=self._decode_timeout,
                ))
                await self._raise_for_status(upstream, response)
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise _failure(upstream, exc) from exc
            yield DecodeStream(upstream, response, work_done)

    async def get(self, router: Router, upstream: Upstream, path: str) -> tuple[int, bytes, str]:
        """A GET (models); a 4xx comes back as it is, a 5xx or no answer raises UpstreamError."""
        async with self._call(router, upstream):
            try:
                url = self._config.base_url(upstream) + path
                async with self._session.get(url, timeout=self._health_timeout) as response:
                    if response.status >= 500:
                        await self._raise_for_status(upstream, response)
                    return response.status, await response.read(), response.headers.get(
                        "Content-Type", "application/json"
                    )
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise _failure(upstream, exc) from exc

    async def tokenize(self, upstream: Upstream, body: dict[str, Any]) -> list[int] | None:
        """A node's `POST /tokenize` of `body`: its token ids, or None when it cannot say (any failure: the caller
        then routes without a prediction, and the request itself meets the node's verdict)."""
        try:
            async with self._session.post(self._config.base_url(upstream) + "/tokenize", json=body,
                                          timeout=self._health_timeout) as response:
                if response.status != 200:
                    return None
                tokens = (await response.json()).get("tokens")
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            return None
        return tokens if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens) else None

    async def probe(self, upstream: Upstream) -> tuple[int | None, str]:
        """GET /health without counting it as a call: (status or None, a short detail)."""
        try:
            url = self._config.base_url(upstream) + "/health"
            async with self._session.get(url, timeout=self._health_timeout) as response:
                await response.read()
                return response.status, f"HTTP {response.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return None, _failure(upstream, exc).reason
