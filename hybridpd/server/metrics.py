"""The node front's request-level Prometheus metrics, registered in the registry it is given (never the global one):
vLLM's names, labels and buckets (hybridpd/vllm_metrics.py), plus our HTTP counter. The engine process exports its
own families (scheduler gauges, the prefix-cache and prompt-source counters, per-group cache figures, the
connector's) through the same `/metrics`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram

from hybridpd import vllm_metrics as vm
from hybridpd.engine.request import FinishReason, RequestOutput

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str = "model", max_model_len: int = 4096) -> None:
        labels = vm.label_values(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, vm.LABELS, registry=registry).labels(**labels)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, vm.LABELS, buckets=buckets, registry=registry).labels(**labels)

        self.http_requests = Counter(
            "hybridpd:http_requests", "HTTP requests by route and status", ["endpoint", "status"], registry=registry
        )
        self.prompt_tokens = counter(vm.PROMPT_TOKENS, "Number of prefill tokens processed.")
        self.generation_tokens = counter(vm.GENERATION_TOKENS, "Number of generation tokens processed.")
        self._request_success = Counter(vm.REQUEST_SUCCESS, "Count of successfully processed requests.",
                                        [*vm.LABELS, "finished_reason"], registry=registry)
        self._labels = labels
        self.request_prompt_tokens = histogram(vm.REQUEST_PROMPT_TOKENS, "Number of prefill tokens processed.",
                                               vm.buckets_1_2_5(max_model_len))
        self.request_generation_tokens = histogram(vm.REQUEST_GENERATION_TOKENS,
                                                   "Number of generation tokens processed.",
                                                   vm.buckets_1_2_5(max_model_len))
        self.time_to_first_token = histogram(vm.TIME_TO_FIRST_TOKEN, "Histogram of time to first token in seconds.",
                                             vm.TTFT_BUCKETS)
        self.inter_token_latency = histogram(vm.INTER_TOKEN_LATENCY, "Histogram of inter-token latency in seconds.",
                                             vm.ITL_BUCKETS)
        self.e2e_request_latency = histogram(vm.E2E_REQUEST_LATENCY, "Histogram of e2e request latency in seconds.",
                                             vm.REQUEST_LATENCY_BUCKETS)

    def request_success(self, finished_reason: str) -> Counter:
        return self._request_success.labels(**self._labels, finished_reason=finished_reason)

    def tracker(self, keep_output: bool = False) -> RequestTracker:
        return RequestTracker(self, time.monotonic, keep_output)


class RequestTracker:
    """Watches one request's outputs as they pass: TTFT at the first output with tokens, ITL between later ones,
    token counts and e2e latency at the finished one."""

    def __init__(self, metrics: ServerMetrics, clock: Callable[[], float], keep_output: bool = False) -> None:
        self._metrics = metrics
        self._clock = clock
        self._arrival = clock()
        self._last_token_time: float | None = None
        self._seen = False
        self._generated = 0
        # what the request's trace records afterwards (server/app.py)
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.scheduled_at: float | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        # with `keep_output`, the output's text and token ids as they pass (what --enable-log-outputs logs)
        self.texts: list[str] | None = [] if keep_output else None
        self.token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None

    @property
    def arrival(self) -> float:
        return self._arrival

    @property
    def generated(self) -> int:
        return self._generated

    def observe(self, output: RequestOutput) -> None:
        now = self._clock()
        if not self._seen:   # the request's first output: its prompt and its prefix hit are known
            self._seen = True
            self.scheduled_at = output.scheduled_at
            self.prompt_tokens, self.cached_tokens = output.num_prompt_tokens, output.num_cached_tokens
        if self.texts is not None:
            self.texts.append(output.new_text)
            self.token_ids.extend(output.new_token_ids)
        if output.new_token_ids:
            self._metrics.generation_tokens.inc(len(output.new_token_ids))
            self._generated += len(output.new_token_ids)
            if self._last_token_time is None:
                self._metrics.time_to_first_token.observe(now - self._arrival)
                self.first_token_at = now
            else:
                self._metrics.inter_token_latency.observe(now - self._last_token_time)
            self._last_token_time = now
        if output.finished:
            self.finished_at = now
            self.finish_reason = output.finish_reason
            self._metrics.prompt_tokens.inc(output.num_prompt_tokens)
            self._metrics.request_prompt_tokens.observe(output.num_prompt_tokens)
            self._metrics.request_generation_tokens.observe(self._generated)
            self._metrics.e2e_request_latency.observe(now - self._arrival)
            reason = output.finish_reason.value if output.finish_reason is not None else "unknown"
            self._metrics.request_success(reason).inc()


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
