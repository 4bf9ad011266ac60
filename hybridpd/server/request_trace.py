"""The node's spans of one request, recorded when its handler ends (hybridpd/tracing.py).

    node request                     the handler, child of the caller's traceparent (the proxy's call span)
      ├── queue                      arrival -> the engine first took it from its queue
      ├── first token                arrival -> its first token (TTFT as this node saw it)
      └── last token                 first token -> its last (the decode)

Its attributes follow vLLM's `gen_ai.*` names, plus the node's role for the request and its local prefix hit. The
engine process's own spans of the request (lease grant, pull, READ, heartbeat) nest under `node request` through
`EngineRequest.trace_context`.
"""

from __future__ import annotations

from hybridpd.engine.transfer_params import RemoteDecodeParams, RemotePrefillParams
from hybridpd.server.metrics import RequestTracker
from hybridpd.server.protocol import ParsedRequest
from hybridpd.tracing import Span, Tracer


def role_of(parsed: ParsedRequest) -> str:
    params = parsed.engine_request.kv_transfer
    if isinstance(params, RemoteDecodeParams):
        return "prefill"
    return "decode" if isinstance(params, RemotePrefillParams) else "colocated"


def record_request(tracer: Tracer, span: Span, parsed: ParsedRequest, tracker: RequestTracker) -> None:
    request = parsed.engine_request
    arrival, first, last = tracker.arrival, tracker.first_token_at, tracker.finished_at
    attributes = {
        "gen_ai.request.id": request.request_id,
        "gen_ai.request.max_tokens": request.sampling.max_tokens,
        "gen_ai.usage.prompt_tokens": tracker.prompt_tokens,
        "gen_ai.usage.completion_tokens": tracker.generated,
        "hybridpd.role": role_of(parsed),
        "hybridpd.cached_tokens": tracker.cached_tokens,
    }
    if first is not None:
        attributes["gen_ai.latency.time_to_first_token"] = first - arrival
    if last is not None:
        attributes["gen_ai.latency.e2e"] = last - arrival
    if tracker.scheduled_at is not None:
        attributes["gen_ai.latency.time_in_queue"] = max(0.0, tracker.scheduled_at - arrival)
    span.set(attributes)
    parent = span.carrier()
    if tracker.scheduled_at is not None:
        tracer.record("queue", parent, arrival, max(arrival, tracker.scheduled_at))
    if first is not None:
        tracer.record("first token", parent, arrival, first)
        if last is not None:
            tracer.record("last token", parent, first, last, {"gen_ai.usage.completion_tokens": tracker.generated})
