"""One P/D request through `hybridpd up` with `--otlp-traces-endpoint` on the proxy and every node yields one trace:
it carries the client's `traceparent` trace id, its spans nest as the request travels (proxy -> prefill node ->
lease; proxy -> decode node -> pull -> the prefill node's heartbeat, the READ), and their durations add up to what
the client measured.

The spans are received by an OTLP/HTTP endpoint served in the test (the processes are separate, so the SDK's in-memory
exporter cannot see them): what it receives is what a collector would.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from hybridpd.launcher.ports import free_cluster_ports
from tests.e2e.nodes import make_tiny_checkpoint
from tests.e2e.test_chaos import _get_json, _wait_until
from tests.e2e.test_up import _children, _kill_leftovers, _stop

STARTUP_S = 240.0
NESTING = [  # (span, its parent)
    ("routing", "proxy request"),
    ("prefill call", "proxy request"),
    ("decode call", "proxy request"),
    ("node request/prefill", "prefill call"),
    ("lease grant", "node request/prefill"),
    ("queue/prefill", "node request/prefill"),
    ("node request/decode", "decode call"),
    ("kv pull", "node request/decode"),
    ("read", "kv pull"),
    ("heartbeat (prefill node)", "kv pull"),
    ("first token/decode", "node request/decode"),
    ("last token/decode", "node request/decode"),
]


class Collector(BaseHTTPRequestHandler):
    spans: list = []
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        request = ExportTraceServiceRequest()
        request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            for resource in request.resource_spans:
                service = next(a.value.string_value for a in resource.resource.attributes if a.key == "service.name")
                for scope in resource.scope_spans:
                    self.spans.extend((service, span) for span in scope.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def collector():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    Collector.spans = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    finally:
        server.shutdown()


def _role(span) -> str:
    return next((a.value.string_value for a in span.attributes if a.key == "hybridpd.role"), "")


def test_a_pd_request_is_one_trace_whose_spans_nest_and_add_up(collector, tmp_path):
    model = make_tiny_checkpoint(tmp_path / "tiny")
    proxy_port, base = free_cluster_ports(2)
    up = subprocess.Popen(
        [sys.executable, "-m", "hybridpd", "up", "--prefill", "1", "--decode", "1", "--model", str(model),
         "--port", str(proxy_port), "--base-port", str(base), "--run-dir", str(tmp_path / "run"),
         f"--proxy-arg=--otlp-traces-endpoint={collector}", "--",
         "--kv-cache-memory", "64MiB", "--otlp-traces-endpoint", collector],
        stdout=open(tmp_path / "up.log", "wb"), stderr=subprocess.STDOUT)
    proxy = f"http://127.0.0.1:{proxy_port}"
    try:
        _wait_until(lambda: up.poll() is None and _get_json(proxy + "/health")[0] == 200, "the cluster is up",
                    STARTUP_S)
        trace_id = secrets.token_hex(16)
        body = {"prompt": list(range(5, 70)), "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(proxy + "/v1/completions", data=json.dumps(body).encode(), headers={
            "Content-Type": "application/json", "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
            response.read()
        client_s = time.perf_counter() - start

        def ours() -> list:
            with Collector.lock:
                return [span for _, span in Collector.spans if span.trace_id.hex() == trace_id]

        _wait_until(lambda: {s.name for s in ours()} >= {"proxy request", "last token", "read", "lease grant",
                                                         "heartbeat (prefill node)"}, "every process's spans", 30)
        spans = ours()
        by_key = {}
        for span in spans:
            key = f"{span.name}/{_role(span)}" if span.name in ("node request",) else span.name
            by_key.setdefault(key, span)
        for span in spans:   # queue / first / last token spans take their role from their node request
            parent = next((p for p in spans if p.span_id == span.parent_span_id), None)
            if span.name in ("queue", "first token", "last token") and parent is not None:
                by_key.setdefault(f"{span.name}/{_role(parent)}", span)
        for child, parent in NESTING:
            assert child in by_key and parent in by_key, (child, parent, sorted(by_key))
            assert by_key[child].parent_span_id == by_key[parent].span_id, f"{child} is not a child of {parent}"
        root = by_key["proxy request"]
        assert root.parent_span_id != b""   # the client's own span (its traceparent) is the root's parent

        def seconds(span) -> float:
            return (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9

        # Durations add up (margins: scheduling and clocks of separate processes on one host, a few ms):
        assert seconds(root) <= client_s + 0.005
        parts = seconds(by_key["routing"]) + seconds(by_key["prefill call"]) + seconds(by_key["decode call"])
        assert 0.8 * seconds(root) <= parts <= seconds(root) + 0.005, (parts, seconds(root))
        for child, parent in NESTING:
            assert seconds(by_key[child]) <= seconds(by_key[parent]) + 0.010, (child, parent)
        read = by_key["read"]
        attributes = {a.key: a.value for a in read.attributes}
        assert attributes["hybridpd.read.bytes"].int_value > 0 and attributes["hybridpd.read.groups"].int_value >= 1
    finally:
        _stop(up)
        _kill_leftovers(_children([proxy_port, base, base + 1]))
