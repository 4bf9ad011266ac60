"""Tracing off costs nothing: no OpenTelemetry import, spans that do nothing, carriers that carry nothing; the W3C
headers are picked out of any header mapping."""

from __future__ import annotations

import subprocess
import sys

from hybridpd.tracing import NoTracer, carrier_of, start_tracing


def test_without_an_endpoint_the_tracer_does_nothing_and_imports_nothing():
    code = ("import sys; from hybridpd.tracing import start_tracing; t = start_tracing('x', None)\n"
            "with t.span('a', {'traceparent': '00-' + '1' * 32 + '-' + '2' * 16 + '-01'}) as s:\n"
            "    assert s.carrier() == {}\n"
            "t.record('b', None, 0.0, 1.0); t.shutdown()\n"
            "print(any(m.startswith('opentelemetry') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    assert isinstance(start_tracing("x", None), NoTracer)


def test_the_carrier_is_the_w3c_headers_only():
    headers = {"traceparent": "00-abc-def-01", "tracestate": "k=v", "authorization": "Bearer x", "x": "y"}
    assert carrier_of(headers) == {"traceparent": "00-abc-def-01", "tracestate": "k=v"}
    assert carrier_of({}) == {}

