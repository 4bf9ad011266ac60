"""The node front's request-level Prometheus metrics, registered in the registry it is given (never the global one):
vLLM's names, labels and buckets (hybridpd/vllm_metrics.py), plus our HTTP counter. The engine process exports its
own families (scheduler gauges, the prefix-cache and prompt-source counters, per-group cache figures, the
connector's) through the same `/metrics`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

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
        for reason in vm.FINISHED_REASONS:
            self.request_success(reason)
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
        # a finished request's phases, as vLLM splits them (`RequestPhases`)
        self.queue_time = histogram(vm.REQUEST_QUEUE_TIME, "Histogram of time spent in WAITING phase for request.",
                                    vm.REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram(vm.REQUEST_PREFILL_TIME, "Histogram of time spent in PREFILL phase for request.",
                                      vm.REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram(vm.REQUEST_DECODE_TIME, "Histogram of time spent in DECODE phase for request.",
                                     vm.REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram(vm.REQUEST_INFERENCE_TIME, "Histogram of time spent in RUNNING phase for "
                                        "request.", vm.REQUEST_LATENCY_BUCKETS)
        self.time_per_output_token = histogram(vm.REQUEST_TIME_PER_OUTPUT_TOKEN, "Histogram of "
                                               "time_per_output_token_seconds per request.", vm.ITL_BUCKETS)
        self.prefill_kv_computed = histogram(vm.REQUEST_PREFILL_KV_COMPUTED_TOKENS, "Histogram of new KV tokens "
                                             "computed during prefill (excluding cached tokens).",
                                             vm.buckets_1_2_5(max_model_len))
        self.num_preemptions = histogram(vm.REQUEST_NUM_PREEMPTIONS, "Histogram of the number of times a request "
                                         "was preempted.", vm.REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.params_max_tokens = histogram(vm.REQUEST_PARAMS_MAX_TOKENS, "Histogram of the max_tokens request "
                                           "parameter.", vm.buckets_1_2_5(max_model_len))
        self.params_n = histogram(vm.REQUEST_PARAMS_N, "Histogram of the n request parameter.",
                                  vm.REQUEST_PARAMS_N_BUCKETS)
        self.max_num_generation_tokens = histogram(vm.REQUEST_MAX_NUM_GENERATION_TOKENS, "Histogram of maximum "
                                                   "number of requested generation tokens.",
                                                   vm.buckets_1_2_5(max_model_len))

    def request_success(self, finished_reason: str) -> Counter:
        return self._request_success.labels(**self._labels, finished_reason=finished_reason)

    def tracker(self, keep_output: bool = False, max_tokens: int | None = None,
                one_of_choices: bool = False) -> RequestTracker:
        """A request's tracker; `max_tokens` its parameter; `one_of_choices`: one of a body's several choices (its
        generated tokens then count in `observe_choices`, once per prompt, as vLLM counts its parent request)."""
        return RequestTracker(self, time.monotonic, keep_output, max_tokens, one_of_choices)

    def observe_choices(self, n: int, generated: list[int]) -> None:
        """One prompt of a body with `n` choices per prompt, whose choices generated `generated` tokens."""
        self.params_n.observe(n)
        if generated:
            self.max_num_generation_tokens.observe(max(generated))


class RequestTracker:
    """Watches one request's outputs as they pass: TTFT at the first output with tokens, ITL between later ones,
    token counts and e2e latency at the finished one."""

    def __init__(self, metrics: ServerMetrics, clock: Callable[[], float], keep_output: bool = False,
                 max_tokens: int | None = None, one_of_choices: bool = False) -> None:
        self._metrics = metrics
        self._max_tokens = max_tokens
        self._one_of_choices = one_of_choices
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
        if self.scheduled_at is None:   # (a decode node's first output, the prefill node's token, comes before)
            self.scheduled_at = output.scheduled_at
        if not self._seen:   # the request's first output: its prompt and its prefix hit are known
            self._seen = True
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
            self._observe_finished(output)

    def _observe_finished(self, output: RequestOutput) -> None:
        """vLLM's per-request histograms of a finished request: its phases (`RequestPhases`), tokens and
        parameters."""
        metrics = self._metrics
        phases = RequestPhases.of(self._arrival, self.scheduled_at, self.first_token_at, self._last_token_time,
                                  self._generated)
        if phases is not None:
            metrics.queue_time.observe(phases.queue)
            metrics.prefill_time.observe(phases.prefill)
            metrics.decode_time.observe(phases.decode)
            metrics.inference_time.observe(phases.inference)
            metrics.time_per_output_token.observe(phases.per_output_token)
        computed = output.num_prompt_tokens - output.num_cached_tokens - output.num_pulled_tokens
        metrics.prefill_kv_computed.observe(max(computed, 0))   # a decode node computes none of a pulled prompt
        metrics.num_preemptions.observe(output.num_preemptions)
        if self._max_tokens:
            metrics.params_max_tokens.observe(self._max_tokens)
        if not self._one_of_choices:
            metrics.params_n.observe(1)
            metrics.max_num_generation_tokens.observe(self._generated)


@dataclass(frozen=True)
class RequestPhases:
    """A finished request's phases as vLLM splits them (vllm/v1/metrics/stats.py), in seconds: queue, from its
    arrival (at this node's front) to the engine's first scheduling of it; prefill, from there to its first token;
    decode, from its first token to its last; inference, from its scheduling to its last token; and the mean time
    per output token after the first. On a P/D decode node the first token is the prefill node's, streamed before
    the request is scheduled here: its prefill is 0 and its decode holds the pull."""

    queue: float
    prefill: float
    decode: float
    inference: float
    per_output_token: float

    @classmethod
    def of(cls, arrival: float, scheduled: float | None, first_token: float | None, last_token: float | None,
           generated: int) -> RequestPhases | None:
        """The phases, or None for a request that was never scheduled or generated nothing."""
        if scheduled is None or first_token is None or last_token is None:
            return None
        decode = last_token - first_token
        return cls(queue=max(scheduled - arrival, 0.0), prefill=max(first_token - scheduled, 0.0), decode=decode,
                   inference=max(last_token - scheduled, 0.0),
                   per_output_token=decode / (generated - 1) if generated > 1 else 0.0)


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
