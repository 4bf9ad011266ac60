"""The server's HTTP-level Prometheus metrics, registered in the registry it is given (never the global one).

Names follow vLLM's `vllm:*` with our prefix. The engine registers its own gauges in the same registry.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram

from hybridpd.engine.request import RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.http_requests = Counter(
            "hybridpd:http_requests", "HTTP requests by route and status", ["endpoint", "status"], registry=registry
        )
        self.prompt_tokens = Counter("hybridpd:prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self.generation_tokens = Counter("hybridpd:generation_tokens", "Generated tokens", registry=registry)
        self.request_success = Counter(
            "hybridpd:request_success", "Finished requests by finish reason", ["finished_reason"], registry=registry
        )
        self.time_to_first_token = Histogram(
            "hybridpd:time_to_first_token_seconds", "Time from arrival to the first output token",
            buckets=TTFT_BUCKETS, registry=registry,
        )
        self.inter_token_latency = Histogram(
            "hybridpd:inter_token_latency_seconds", "Time between consecutive outputs of a request",
            buckets=ITL_BUCKETS, registry=registry,
        )
        self.e2e_request_latency = Histogram(
            "hybridpd:e2e_request_latency_seconds", "Time from arrival to the last output",
            buckets=E2E_BUCKETS, registry=registry,
        )

    def tracker(self) -> RequestTracker:
        return RequestTracker(self, time.monotonic)


class RequestTracker:
    """Watches one request's outputs as they pass: TTFT at the first output with tokens, ITL between later ones,
    token counts and e2e latency at the finished one."""

    def __init__(self, metrics: ServerMetrics, clock: Callable[[], float]) -> None:
        self._metrics = metrics
        self._clock = clock
        self._arrival = clock()
        self._last_token_time: float | None = None

    def observe(self, output: RequestOutput) -> None:
        now = self._clock()
        if output.new_token_ids:
            self._metrics.generation_tokens.inc(len(output.new_token_ids))
            if self._last_token_time is None:
                self._metrics.time_to_first_token.observe(now - self._arrival)
            else:
                self._metrics.inter_token_latency.observe(now - self._last_token_time)
            self._last_token_time = now
        if output.finished:
            self._metrics.prompt_tokens.inc(output.num_prompt_tokens)
            self._metrics.e2e_request_latency.observe(now - self._arrival)
            reason = output.finish_reason.value if output.finish_reason is not None else "unknown"
            self._metrics.request_success.labels(finished_reason=reason).inc()


def _endpoint_label(request: web.Request) -> str:
    """The matched route's path, or "unmatched" (so unknown URLs cannot grow the label set)."""
    route = request.match_info.route
    return route.resource.canonical if route.resource is not None else "unmatched"


def metrics_middleware(metrics: ServerMetrics) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    @web.middleware
    async def count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        metrics.http_requests.labels(endpoint=_endpoint_label(request), status=str(response.status)).inc()
        return response

    return count_requests
