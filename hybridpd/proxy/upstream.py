"""Calls from the proxy to one node over the app's one shared ClientSession.

Every failure leaves as a typed error: `UpstreamRejectedError` for a 4xx (passes through to the client),
`UpstreamError` for everything else (a 5xx, no connection, a timeout, an unusable answer).
Every call is counted as outstanding on its router while it runs, timed in the metrics, and its outcome goes to the
router's outlier detector (proxy/outliers.py): a 4xx is the client's fault and counts as the node answering.

Timeouts: every generation call sends `Expect: 100-continue` and must see the node's first byte (the `100 Continue`
its HTTP front sends as soon as it reads the call) within `prefill_first_byte_timeout` / `decode_first_byte_timeout`,
so a node that accepts connections but never answers (a stopped process, a stuck event loop) costs seconds, not the
whole timeout, and the call is retried elsewhere (the node never read its body). A prefill call whose node is
ejected while it runs is given up and retried too. A streamed decode call's read timeout is the gap between two
chunks; a non-streamed one's covers the whole generation (`decode_request_timeout`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from hybridpd.proxy.bodies import wants_stream
from hybridpd.proxy.config import ProxyConfig, Upstream
from hybridpd.proxy.errors import FailureKind, UpstreamError, UpstreamRejectedError
from hybridpd.proxy.metrics import ProxyMetrics
from hybridpd.proxy.prefill_stream import SSE_CONTENT_TYPE, PrefillStreamError, read_prefill_stream
from hybridpd.proxy.outliers import OutlierDetector
from hybridpd.proxy.routing import Router
from hybridpd.wire_headers import CACHED_TOKENS_HEADER, CLUSTER_TOKEN_HEADER, LEASE_RELEASE_PATH
from hybridpd.stream_head import StreamHead

_ERROR_SNIPPET = 300  # characters of a node's 5xx body quoted in our 502
_EJECTION_CHECK_S = 0.5  # how often a prefill call under way looks whether its node was ejected


def _failure(upstream: Upstream, exc: BaseException) -> UpstreamError:
    """Classifies a transport-level exception; a connect timeout means the node is unreachable."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return UpstreamError(upstream, FailureKind.UNREACHABLE, "connect timed out")
    if isinstance(exc, aiohttp.ClientConnectorError) and not isinstance(exc, aiohttp.ClientSSLError):
        return UpstreamError(upstream, FailureKind.UNREACHABLE, f"{type(exc).__name__}: {exc}", nothing_sent=True)
    if isinstance(exc, TimeoutError):
        return UpstreamError(upstream, FailureKind.TIMEOUT, "no answer within the timeout")
    return UpstreamError(upstream, FailureKind.UNREACHABLE, f"{type(exc).__name__}: {exc}")


def first_byte_trace() -> aiohttp.TraceConfig:
    """The session's hook that tells a prefill call its node answered: with `Expect: 100-continue` the body goes out
    only once the node's `100 Continue` (or its final answer) came, and the call's `trace_request_ctx` is an
    asyncio.Event."""
    async def body_sent(_session: aiohttp.ClientSession, context: Any, _params: Any) -> None:
        if isinstance(context.trace_request_ctx, asyncio.Event):
            context.trace_request_ctx.set()

    trace = aiohttp.TraceConfig()
    trace.on_request_chunk_sent.append(body_sent)
    return trace


async def _first_byte(upstream: Upstream, task: asyncio.Future, first_byte: asyncio.Event, timeout: float) -> None:
    """Returns once the node sent its first byte (or the call ended); raises a TIMEOUT that sent nothing (the body
    goes out only after the node's 100 Continue) when neither came within `timeout` seconds."""
    waiter = asyncio.ensure_future(first_byte.wait())
    try:
        await asyncio.wait({task, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if not first_byte.is_set() and not task.done():
        task.cancel()
        raise UpstreamError(upstream, FailureKind.TIMEOUT, f"no first byte within {timeout:g} s", nothing_sent=True)


def _cached_tokens(response: aiohttp.ClientResponse) -> int | None:
    value = response.headers.get(CACHED_TOKENS_HEADER, "")
    return int(value) if value.isdigit() else None


@dataclass(frozen=True, kw_only=True)
class HeldLease:
    """The lease a prefill node holds for a request until its decode side takes it: which node, and what proves the
    holder (the answer's `remote_request_id` and `remote_lease_secret`)."""

    upstream: Upstream
    request_id: str
    secret: str = field(repr=False)

    @classmethod
    def of(cls, upstream: Upstream, params: dict[str, Any] | None) -> HeldLease | None:
        params = params or {}
        request_id, secret = params.get("remote_request_id"), params.get("remote_lease_secret")
        if isinstance(request_id, str) and request_id and isinstance(secret, str) and secret:
            return cls(upstream=upstream, request_id=request_id, secret=secret)
        return None


@dataclass(frozen=True, kw_only=True)
class PrefillAnswer:
    kv_transfer_params: dict[str, Any] | None
    cached_tokens: int | None   # the prefill node's prefix hit, when it said
    # A streamed call's head of the client's stream and what the decode node continues (proxy/prefill_stream.py);
    # empty / None for a JSON answer.
    head: bytes = b""
    stream_head: StreamHead | None = None
    lease: HeldLease | None = None   # to release when no decode node takes the request


class DecodeStream:
    """An open 2xx answer of a decode node: its status and content type, and its bytes as they come."""

    def __init__(self, upstream: Upstream, response: aiohttp.ClientResponse,
                 call: InFlightCall | None = None, outliers: OutlierDetector | None = None) -> None:
        self.upstream = upstream
        self._outliers = outliers
        self.status = response.status
        self.content_type = response.headers.get("Content-Type", "application/json")
        self.cached_tokens = _cached_tokens(response)
        self._response = response
        self._call = call   # the prompt's work is over once the first bytes (the first token) arrive

    async def chunks(self) -> AsyncIterator[bytes]:
        first = True
        try:
            async for chunk in self._response.content.iter_any():
                if first:
                    if self._call is not None:
                        self._call.work_done()
                    first = False
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._broken(exc) from exc

    async def read_all(self) -> bytes:
        try:
            return await self._response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._broken(exc) from exc

    def _broken(self, exc: BaseException) -> UpstreamError:
        """A stream that breaks midway is the node's failure, as a failed call is."""
        error = _failure(self.upstream, exc)
        if self._call is not None:
            self._call.broken = True
        if self._outliers is not None:
            self._outliers.call_failed(self.upstream, str(error))
        return error


@dataclass(kw_only=True)
class InFlightCall:
    """A call while it runs: what to call once the node has done its prompt's work (`Router.in_flight`), and whether
    its stream broke after the call itself had opened (then it is no success for the outlier detector)."""

    work_done: Callable[[], None]
    broken: bool = False


class UpstreamClient:
    def __init__(self, session: aiohttp.ClientSession, config: ProxyConfig, metrics: ProxyMetrics) -> None:
        self._session = session
        self._config = config
        self._metrics = metrics
        self._prefill_timeout = aiohttp.ClientTimeout(
            total=config.prefill_timeout, sock_connect=config.connect_timeout
        )
        self._stream_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout, sock_read=config.decode_timeout
        )
        self._whole_call_timeout = aiohttp.ClientTimeout(
            total=config.decode_request_timeout, sock_connect=config.connect_timeout
        )
        self._health_timeout = aiohttp.ClientTimeout(
            total=config.health_timeout, sock_connect=min(config.connect_timeout, config.health_timeout)
        )

    def _headers(self, request_id: str, body: dict[str, Any], trace: Mapping[str, str] = {}) -> dict[str, str]:
        """The node checks the cluster token only on calls that carry kv_transfer_params; only those get it. `trace`:
        the W3C headers of the call's span (hybridpd/tracing.py)."""
        headers = {"X-Request-Id": request_id, **trace, **self._config.api_keys.headers()}
        if self._config.cluster_token is not None and "kv_transfer_params" in body:
            headers[CLUSTER_TOKEN_HEADER] = self._config.cluster_token
        return headers

    @contextlib.asynccontextmanager
    async def _call(self, router: Router, upstream: Upstream,
                    work_tokens: int = 0) -> AsyncIterator[InFlightCall]:
        """Counts, times and tracks one call; records its failure kind if it raises, and its outcome in the router's
        outlier detector. Yields the call in flight (`InFlightCall`)."""
        self._metrics.count_call(upstream)
        start = time.perf_counter()
        try:
            with router.in_flight(upstream, work_tokens) as work_done:
                self._metrics.set_outstanding(upstream, router.outstanding(upstream))
                call = InFlightCall(work_done=work_done)
                yield call
        except UpstreamError as exc:
            self._metrics.count_error(upstream, exc.kind.value)
            router.outliers.call_failed(upstream, str(exc), conclusive=exc.kind is FailureKind.UNREACHABLE
                                        and exc.nothing_sent)
            raise
        except UpstreamRejectedError:
            self._metrics.count_error(upstream, "rejected")
            router.outliers.call_succeeded(upstream)
            raise
        else:
            if not call.broken:
                router.outliers.call_succeeded(upstream)
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
        work_tokens: int = 0, trace: Mapping[str, str] = {},
    ) -> PrefillAnswer:
        """Runs the prefill call; returns the answer's top-level `kv_transfer_params` (None when absent) and, for a
        streamed call, the head of the client's stream."""
        async with self._call(router, upstream, work_tokens):
            raw, cached, streamed = await self._prefill_call(router, upstream, path, body, request_id, trace)
            if streamed:
                try:
                    stream = read_prefill_stream(raw)
                except PrefillStreamError as exc:
                    kind = FailureKind.SERVER_ERROR if exc.from_node else FailureKind.BAD_ANSWER
                    raise UpstreamError(upstream, kind, str(exc)) from exc
                return PrefillAnswer(kv_transfer_params=stream.kv_transfer_params, cached_tokens=cached,
                                     head=stream.head, stream_head=stream.stream_head,
                                     lease=HeldLease.of(upstream, stream.kv_transfer_params))
            try:
                answer = json.loads(raw)
            except ValueError as exc:
                raise UpstreamError(upstream, FailureKind.BAD_ANSWER, "answer is not JSON") from exc
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
            if params is not None and not isinstance(params, dict):
                raise UpstreamError(upstream, FailureKind.BAD_ANSWER, "kv_transfer_params is not an object")
            return PrefillAnswer(kv_transfer_params=params, cached_tokens=cached, lease=HeldLease.of(upstream, params))

    async def _prefill_call(self, router: Router, upstream: Upstream, path: str, body: dict[str, Any],
                            request_id: str, trace: Mapping[str, str]) -> tuple[bytes, int | None, bool]:
        """The answer's bytes, the node's reported hit and whether it streamed. The node's first byte must come within
        `prefill_first_byte_timeout`; a call still under way when its node is ejected (its probes failed: a wedged
        or stopped engine) is given up, to be retried elsewhere (a prefill is idempotent until it answers)."""
        first_byte = asyncio.Event()

        async def call() -> tuple[bytes, int | None, bool]:
            async with self._session.post(
                self._config.base_url(upstream) + path, json=body, headers=self._headers(request_id, body, trace),
                timeout=self._prefill_timeout, expect100=True, trace_request_ctx=first_byte,
            ) as response:
                first_byte.set()
                await self._raise_for_status(upstream, response)
                raw = await response.read()
                return raw, _cached_tokens(response), response.headers.get("Content-Type", "").startswith(
                    SSE_CONTENT_TYPE)

        task = asyncio.ensure_future(call())
        try:
            await _first_byte(upstream, task, first_byte, self._config.prefill_first_byte_timeout)
            while not (await asyncio.wait({task}, timeout=_EJECTION_CHECK_S))[0]:
                if not router.outliers.available(upstream):
                    raise UpstreamError(upstream, FailureKind.TIMEOUT, "ejected from rotation while the call ran")
            return task.result()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _failure(upstream, exc) from exc
        finally:
            task.cancel()

    @contextlib.asynccontextmanager
    async def decode(
        self, router: Router, upstream: Upstream, path: str, body: dict[str, Any], request_id: str,
        work_tokens: int = 0, trace: Mapping[str, str] = {},
    ) -> AsyncIterator[DecodeStream]:
        """Opens the decode call; the connection closes (and the node sees it) when the block exits.

        Only opening the call is guarded here: an error raised by the block itself (the client went
        away while we wrote to it) is not the node's failure and passes through untouched. A node that sends no
        first byte (its 100 Continue) within `decode_first_byte_timeout` never read the call's body: that is a
        failure with nothing sent, which the caller may retry on another decode node.
        """
        async with self._call(router, upstream, work_tokens) as call, contextlib.AsyncExitStack() as stack:
            first_byte = asyncio.Event()
            opening = self._session.post(
                self._config.base_url(upstream) + path, json=body, headers=self._headers(request_id, body, trace),
                timeout=self._stream_timeout if wants_stream(body) else self._whole_call_timeout,
                expect100=True, trace_request_ctx=first_byte,
            )
            task = asyncio.ensure_future(opening.__aenter__())
            try:
                await _first_byte(upstream, task, first_byte, self._config.decode_first_byte_timeout)
                response = await task
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise _failure(upstream, exc) from exc
            finally:
                task.cancel()
            stack.push_async_exit(opening)
            await self._raise_for_status(upstream, response)
            yield DecodeStream(upstream, response, call, router.outliers)

    async def call(self, router: Router, upstream: Upstream, method: str, path: str,
                   body: bytes | None = None) -> tuple[int, bytes, str]:
        """A short call passed through (models, the tokenizer's endpoints): a 4xx comes back as it is, a 5xx or no
        answer raises UpstreamError."""
        headers = {**({"Content-Type": "application/json"} if body is not None else {}),
                   **self._config.api_keys.headers()}
        async with self._call(router, upstream):
            try:
                url = self._config.base_url(upstream) + path
                async with self._session.request(method, url, data=body, headers=headers,
                                                 timeout=self._health_timeout) as response:
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

    async def release_lease(self, lease: HeldLease) -> bool:
        """Ask the prefill node to end `lease` (no decode node took the request); False when it could not be told
        (the lease then expires by itself)."""
        headers = {CLUSTER_TOKEN_HEADER: self._config.cluster_token} if self._config.cluster_token else {}
        body = {"remote_request_id": lease.request_id, "remote_lease_secret": lease.secret}
        try:
            async with self._session.post(self._config.base_url(lease.upstream) + LEASE_RELEASE_PATH, json=body,
                                          headers=headers, timeout=self._health_timeout) as response:
                await response.read()
                return response.status == 202
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def probe(self, upstream: Upstream) -> tuple[int | None, str]:
        """GET /health without counting it as a call: (status or None, a short detail)."""
        try:
            url = self._config.base_url(upstream) + "/health"
            async with self._session.get(url, timeout=self._health_timeout) as response:
                await response.read()
                return response.status, f"HTTP {response.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return None, _failure(upstream, exc).reason
