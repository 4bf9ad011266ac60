"""OpenTelemetry traces (`--otlp-traces-endpoint`, vLLM's flag), one trace per request across proxy -> prefill node
-> side channel -> decode node, propagated as W3C `traceparent` headers (HTTP, and gRPC metadata on the side
channel).

Off by default, and then free: without an endpoint every process holds a `NoTracer`, whose calls do nothing and
which never imports OpenTelemetry (an optional extra: `pip install 'hybridpd[otel]'`). With one, spans go out in
batches over OTLP: `http://` or `https://` endpoints over OTLP/HTTP (`.../v1/traces`), anything else
(`grpc://host:4317`, `host:4317`) over OTLP/gRPC, as the OpenTelemetry SDK's exporters do.

What crosses a process boundary is a carrier: a plain `dict[str, str]` of W3C headers, which the engine also keeps
on a request (`EngineRequest.trace_context`) without knowing what it means. Spans whose times are known only
afterwards (a request's queue time, measured by the engine) are recorded with explicit start and end times.
Attribute names follow vLLM's where it has them (`gen_ai.*`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

Carrier = dict[str, str]
TRACE_HEADERS = ("traceparent", "tracestate")


def carrier_of(headers: Mapping[str, str]) -> Carrier:
    """The W3C trace headers among `headers` (HTTP headers, gRPC metadata): what a span's parent is."""
    return {name: headers[name] for name in TRACE_HEADERS if name in headers}


def unix_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` instant (the same clock in every process of a host) as OpenTelemetry's unix ns."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class Span(Protocol):
    def set(self, attributes: Mapping[str, Any]) -> None: ...

    def carrier(self) -> Carrier:
        """W3C headers that make a span in another process this span's child."""
        ...


class Tracer(Protocol):
    def span(self, name: str, parent: Mapping[str, str] | None = None,
             attributes: Mapping[str, Any] | None = None) -> contextlib.AbstractContextManager[Span]: ...

    def record(self, name: str, parent: Mapping[str, str] | None, start_s: float, end_s: float,
               attributes: Mapping[str, Any] | None = None) -> None:
        """A span that already happened, between two `time.monotonic()` instants."""
        ...

    def shutdown(self) -> None: ...


class _NoSpan:
    def set(self, attributes: Mapping[str, Any]) -> None:
        pass

    def carrier(self) -> Carrier:
        return {}


class NoTracer:
    """Tracing off: nothing is recorded, nothing is sent, nothing is imported."""

    _SPAN = _NoSpan()

    @contextlib.contextmanager
    def span(self, name: str, parent: Mapping[str, str] | None = None,
             attributes: Mapping[str, Any] | None = None) -> Iterator[Span]:
        yield self._SPAN

    def record(self, name: str, parent: Mapping[str, str] | None, start_s: float, end_s: float,
               attributes: Mapping[str, Any] | None = None) -> None:
        pass

    def shutdown(self) -> None:
        pass


class _OtelSpan:
    def __init__(self, span: Any, propagator: Any) -> None:
        self._span = span
        self._propagator = propagator

    def set(self, attributes: Mapping[str, Any]) -> None:
        self._span.set_attributes(dict(attributes))

    def carrier(self) -> Carrier:
        from opentelemetry import trace

        carrier: Carrier = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(self._span))
        return carrier


class OtelTracer:
    def __init__(self, service: str, endpoint: str) -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise ValueError("--otlp-traces-endpoint needs OpenTelemetry: pip install 'hybridpd[otel]'") from exc
        if endpoint.startswith(("http://", "https://")):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter(endpoint=endpoint)
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
            target = endpoint.removeprefix("grpc://")
            exporter = GrpcExporter(endpoint=target, insecure=not endpoint.startswith("grpcs://"))
        self._provider = TracerProvider(resource=Resource.create({"service.name": service}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
        self._tracer = self._provider.get_tracer("hybridpd")
        self._propagator = TraceContextTextMapPropagator()

    def _context(self, parent: Mapping[str, str] | None) -> Any:
        return self._propagator.extract(dict(parent)) if parent else None

    @contextlib.contextmanager
    def span(self, name: str, parent: Mapping[str, str] | None = None,
             attributes: Mapping[str, Any] | None = None) -> Iterator[Span]:
        with self._tracer.start_as_current_span(name, context=self._context(parent),
                                                attributes=dict(attributes or {})) as span:
            yield _OtelSpan(span, self._propagator)

    def record(self, name: str, parent: Mapping[str, str] | None, start_s: float, end_s: float,
               attributes: Mapping[str, Any] | None = None) -> None:
        span = self._tracer.start_span(name, context=self._context(parent), start_time=unix_ns(start_s),
                                       attributes=dict(attributes or {}))
        span.end(end_time=unix_ns(end_s))

    def shutdown(self) -> None:
        self._provider.shutdown()


def start_tracing(service: str, endpoint: str | None) -> Tracer:
    """The process's tracer: a real one when an endpoint is given (raises ValueError without the otel extra)."""
    return OtelTracer(service, endpoint) if endpoint else NoTracer()
