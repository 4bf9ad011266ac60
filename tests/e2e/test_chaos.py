"""Chaos under load: `hybridpd up` with 2 prefill + 2 decode nodes serves a bounded stream of mixed
requests (token-id prompts of 20-200 tokens, 2-12 output tokens, streamed or not) at concurrency 16 while a
prefill node is SIGKILLed (and restarted by `up`), then a decode node, and then the other prefill node is paused
(SIGSTOP) past its lease and resumed. Every request either completes with the tokens the same request gets on a
healthy node before the chaos, or fails with a 5xx (or a stream error event) that names a node; none outlives its
timeout. Afterwards the proxy's health shows all four nodes serving and every block is back in its pool."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hybridpd.launcher.ports import free_cluster_ports
from tests.e2e.nodes import NodeProcess, assert_blocks_free, make_tiny_checkpoint, signal_tree
from tests.e2e.test_up import _children, _kill_leftovers, _pids_with_args, _stop

LEASE_S = 3.0
CLIENT_TIMEOUT_S = 150.0
NUM_REQUESTS = 64
CONCURRENCY = 16
STARTUP_S = 240.0


def _post(url: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=CLIENT_TIMEOUT_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _token_ids(raw: bytes, stream: bool) -> tuple[list[int] | None, str | None]:
    """(token ids, None) of a whole answer, or (None, the error message) of a stream that ended in an error."""
    if not stream:
        return json.loads(raw)["choices"][0]["token_ids"], None
    ids: list[int] = []
    for line in raw.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            return None, json.dumps(event["error"])
        for choice in event.get("choices", []):
            ids.extend(choice.get("token_ids") or [])
    return ids, None


def _get_json(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, {}


def _node_pid(port: int) -> int:
    pids = [p for p in _pids_with_args(["--port", str(port)]) if "serve" in Path(f"/proc/{p}/cmdline").read_bytes()
            .decode(errors="replace").split("\0")]
    assert len(pids) == 1, pids
    return pids[0]


def _wait_until(predicate, what: str, timeout: float = STARTUP_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"))
    return model


def start_2p2d(model: Path, tmp_path: Path, up_args: list[str],
               serve_args: list[str]) -> tuple[subprocess.Popen, int, dict[str, int], list[int]]:
    """`hybridpd up --prefill 2 --decode 2` on free ports, its output in tmp_path/up.log: (the process, the proxy's
    port, each node's HTTP port by name, every port to clean up after)."""
    proxy_port, base = free_cluster_ports(4)
    nodes = {"prefill-0": base, "prefill-1": base + 1, "decode-0": base + 2, "decode-1": base + 3}
    up = subprocess.Popen(
        [sys.executable, "-m", "hybridpd", "up", "--prefill", "2", "--decode", "2", "--model", str(model),
         "--port", str(proxy_port), "--base-port", str(base), "--run-dir", str(tmp_path / "run"), *up_args,
         "--", "--kv-cache-memory", "64MiB", *serve_args],
        stdout=open(tmp_path / "up.log", "wb"), stderr=subprocess.STDOUT,
    )
    return up, proxy_port, nodes, [proxy_port, *nodes.values()]


def test_chaos_under_load(tiny, tmp_path):
    up, proxy_port, nodes, ports = start_2p2d(
        tiny, tmp_path,
        ["--proxy-arg=--prefill-timeout=20", "--proxy-arg=--decode-timeout=60", "--proxy-arg=--connect-timeout=2"],
        ["--kv-lease-seconds", str(LEASE_S), "--kv-load-timeout", "20"])
    proxy = f"http://127.0.0.1:{proxy_port}"
    paused: list[int] = []
    try:
        _wait_until(lambda: up.poll() is None and _get_json(proxy + "/health")[0] == 200, "the cluster is up")
        rng = random.Random(5)
        bodies = [{"prompt": [rng.randrange(3, 250) for _ in range(rng.randrange(20, 200))],
                   "max_tokens": rng.randrange(2, 12), "temperature": 0, "ignore_eos": True,
                   "return_token_ids": True, "stream": i % 3 == 0} for i in range(NUM_REQUESTS)]
        healthy = f"http://127.0.0.1:{nodes['decode-0']}"
        expected = [_token_ids(_post(healthy, {**b, "stream": False})[1], False)[0] for b in bodies]

        done = threading.Semaphore(0)

        def one(i: int) -> tuple[int, bytes, float]:
            start = time.monotonic()
            try:
                status, raw = _post(proxy, bodies[i])
            finally:
                done.release()
            return status, raw, time.monotonic() - start

        def chaos() -> None:
            for _ in range(NUM_REQUESTS // 5):
                done.acquire()
            os.kill(_node_pid(nodes["prefill-0"]), signal.SIGKILL)
            for _ in range(NUM_REQUESTS // 5):
                done.acquire()
            os.kill(_node_pid(nodes["decode-1"]), signal.SIGKILL)
            for _ in range(NUM_REQUESTS // 5):
                done.acquire()
            pid = _node_pid(nodes["prefill-1"])
            signal_tree(pid, signal.SIGSTOP)
            paused.append(pid)
            time.sleep(LEASE_S + 2.0)   # past the lease: the pause is the fault being injected
            signal_tree(pid, signal.SIGCONT)
            paused.remove(pid)

        chaos_thread = threading.Thread(target=chaos, daemon=True)
        chaos_thread.start()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            results = list(pool.map(one, range(NUM_REQUESTS)))
        chaos_thread.join(STARTUP_S)
        assert not chaos_thread.is_alive()

        names = [f"127.0.0.1:{p}" for p in nodes.values()] + [f"127.0.0.1:{p + 1000}" for p in nodes.values()]
        completed = 0
        for i, (status, raw, seconds) in enumerate(results):
            assert seconds < CLIENT_TIMEOUT_S
            stream = bodies[i]["stream"]
            if status == 200:
                ids, error = _token_ids(raw, stream)
                if error is None:
                    assert ids == expected[i], f"request {i}: wrong tokens"
                    completed += 1
                    continue
                assert any(n in error for n in names), f"request {i}: a stream error naming no node: {error}"
            else:
                assert status >= 500, (i, status, raw[:300])
                assert any(n.encode() in raw for n in names), f"request {i}: a {status} naming no node: {raw[:300]}"
        assert completed >= NUM_REQUESTS // 2, f"only {completed} of {NUM_REQUESTS} completed"

        def all_serving() -> bool:
            status, body = _get_json(proxy + "/health")
            return status == 200 and all(u["state"] == "healthy" for u in body.get("upstreams", []))

        _wait_until(all_serving, "the restarted nodes serve again")
        assert "restart" in (tmp_path / "up.log").read_text().lower()
        for port in nodes.values():
            view = NodeProcess(None, port, port + 1000, tmp_path / "unused.log")  # type: ignore[arg-type]
            assert_blocks_free(view, timeout=LEASE_S * 4 + 10)
    finally:
        for pid in paused:
            signal_tree(pid, signal.SIGCONT)
        _stop(up)
        _kill_leftovers(_children(ports))
