"""Helpers shared by the fault, tampered-params and fuzz e2e files; it holds no tests itself.

Determinism without sleeps: a node is frozen with SIGSTOP (the kernel still accepts connections into its
backlog, so a peer's call to it is in flight but unanswered), the test waits on a metric of the *other* node
that proves the request reached the stage under test, then acts (kill, disconnect), then SIGCONTs.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.e2e.nodes import NodeProcess, assert_blocks_free, free_port, kill, signal_tree, start_node, terminate

WAIT_S = 60.0          # generous: several engineers' tests share 2 cores
REQUEST_TIMEOUT_S = 90.0
# Node flags for every fault test: small cache, one thread, short enough load timeout that a hang would show.
NODE_ARGS = ("--kv-cache-memory", "32MiB", "--max-model-len", "4096", "--kv-load-timeout", "30")
LEASE_LABEL = "hybridpd:kv_leases_held"
PULLING = 'vllm:num_requests_kv_fetch_by_stage{stage="in_progress"}'   # requests whose KV is being pulled


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    """Poll `predicate` until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def metric(node: NodeProcess, name: str) -> float:
    """The sum over labels of one metric (0 when absent); `name{label="value"}` sums the samples with that label."""
    name, _, having = name.partition("{")
    return sum(value for labels, value in node.metric_values(name).items() if having.rstrip("}") in labels)


def scrape(url: str, name: str, having: str = "") -> float:
    """The sum of metric `name` at `url`/metrics (a node's or the proxy's) over the samples whose label text
    contains `having` (e.g. 'role="prefill"'; "" = every sample)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", line)
        if match and having in (match.group(1) or ""):
            total += float(match.group(2))
    return total


def assert_clean(*nodes: NodeProcess, timeout: float = WAIT_S) -> None:
    """Every block of every node back in its pool, no lease held and no request left in the engine."""
    for node in nodes:
        wait_for(lambda n=node: metric(n, LEASE_LABEL) == 0, f"no lease held on {node.url}", timeout)
        assert_blocks_free(node, timeout=timeout)
        for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", PULLING):
            wait_for(lambda n=node, g=gauge: metric(n, g) == 0, f"{gauge} == 0 on {node.url}", timeout)


@contextlib.contextmanager
def frozen(node: NodeProcess) -> Iterator[None]:
    """SIGSTOP `node` for the block; SIGCONT on the way out (unless it was killed meanwhile)."""
    signal_tree(node.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        if node.proc.poll() is None:
            signal_tree(node.proc.pid, signal.SIGCONT)


def prompt(tag: str, repeat: int = 12) -> str:
    """A prompt of a few hundred tokens that no other test shares (so prefix caches do not blur cases)."""
    return f"[{tag}] the prefill node holds these blocks under a lease; " * repeat


def completion(text: str, max_tokens: int = 6, **extra: Any) -> dict[str, Any]:
    return {"prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


def remote_prefill(node: NodeProcess, body: dict[str, Any]) -> dict[str, Any]:
    """Prefill `body` on `node` for a remote decoder; returns the kv_transfer_params it answered."""
    status, answer = node.post_json(
        "/v1/completions",
        {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}},
        timeout=REQUEST_TIMEOUT_S,
    )
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"], params
    return params


def colocated_text(node: NodeProcess, body: dict[str, Any]) -> str:
    status, answer = node.post_json("/v1/completions", body, timeout=REQUEST_TIMEOUT_S)
    assert status == 200, answer
    return answer["choices"][0]["text"]


def error_message(answer: dict[str, Any]) -> str:
    return answer["error"]["message"]


@dataclass
class StreamingClient:
    """A raw HTTP/1.1 client that reads an SSE answer event by event and can vanish at any point."""

    port: int
    path: str
    body: dict[str, Any]
    conn: http.client.HTTPConnection = field(init=False)
    response: http.client.HTTPResponse | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)

    def send(self) -> None:
        self.conn.request("POST", self.path, json.dumps(self.body), {"Content-Type": "application/json"})

    def read_events(self, count: int) -> list[dict[str, Any]]:
        """Read `count` SSE data events (the status must be 200)."""
        if self.response is None:
            self.response = self.conn.getresponse()
            assert self.response.status == 200, self.response.read()[:500]
        events = []
        while len(events) < count:
            line = self.response.readline()
            assert line, "the stream ended early"
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                events.append(json.loads(line[len(b"data: "):]))
        return events

    def disconnect(self) -> None:
        """Close the socket at once (RST-free close: the server sees EOF)."""
        self.conn.close()


class NodeSlot:
    """One node of a module's topology that a test may kill; `get()` restarts it when it is gone."""

    def __init__(self, model_dir: Path, log_dir: Path, args: Sequence[str], name: str) -> None:
        self.model_dir, self.log_dir, self.args, self.name = model_dir, log_dir, tuple(args), name
        self._node: NodeProcess | None = None

    def get(self) -> NodeProcess:
        if self._node is None or self._node.proc.poll() is not None:
            self._node = start_node(self.model_dir, self.log_dir, self.args, name=self.name)
        return self._node

    def kill(self) -> None:
        """SIGKILL (a frozen node dies as it is: it gets no chance to answer what it was sent)."""
        if self._node is not None:
            self._node.kill()

    def stop(self) -> None:
        if self._node is not None:
            if self._node.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._node.proc.pid, signal.SIGCONT)
            self._node.stop()


def start_all(slots: Iterable[NodeSlot]) -> list[NodeProcess]:
    """Start (or reuse) every slot's node concurrently: start-up is mostly waiting on imports and the model."""
    slots = list(slots)
    with ThreadPoolExecutor(len(slots)) as pool:
        return list(pool.map(NodeSlot.get, slots))


def stop_all(slots: Iterable[NodeSlot]) -> None:
    """SIGTERM every slot's node concurrently and wait for each (SIGKILL after a grace)."""
    slots = list(slots)
    with ThreadPoolExecutor(len(slots)) as pool:
        list(pool.map(NodeSlot.stop, slots))


@dataclass
class ProxyProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post_json(self, path: str, body: Any, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, Any]:
        """(status, parsed JSON answer); a non-JSON answer is returned as text."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def stop(self) -> None:
        terminate(self.proc)

    def kill(self) -> None:
        kill(self.proc)


def start_proxy(prefill: NodeProcess, decode: NodeProcess, log_dir: Path, *, port: int | None = None,
                extra: Sequence[str] = ()) -> ProxyProcess:
    """`hybridpd proxy` in front of one prefill and one decode node; returns once its /health answers 200."""
    port = port or free_port()
    log_path = log_dir / f"proxy-{port}-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "hybridpd", "proxy", "--port", str(port),
           "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(prefill.port),
           "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(decode.port),
           "--prefill-timeout", "60", "--decode-timeout", "60", "--connect-timeout", "5", *extra]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    proxy = ProxyProcess(proc, port, log_path)

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the proxy exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(proxy.url + "/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    try:
        wait_for(healthy, f"the proxy on port {port} to become healthy")
    except BaseException:
        proxy.kill()
        raise
    return proxy
