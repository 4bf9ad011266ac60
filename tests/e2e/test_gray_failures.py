"""Gray failures under load: `hybridpd up --prefill 2 --decode 2` with four requests always in flight, while
- a decode node's HTTP front is stopped (SIGSTOP) for 25 s: it accepts connections and never answers;
- a prefill node's engine process is stopped for 25 s: its front answers, its engine does nothing;
- a decode node's engine process is SIGKILLed: its front exits, `up` restarts the whole node.
In each phase at most a few requests fail or take longer than 10 s, every answer that completes carries the tokens
the same request gets on a healthy node, and every node is back in the proxy's rotation within 45 s after its fault
ends (the bounds are generous on purpose: these are not timing assertions). Afterwards every block is back in its
pool."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import urllib.error
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.nodes import NodeProcess, assert_blocks_free, make_tiny_checkpoint, process_tree
from tests.e2e.test_chaos import CLIENT_TIMEOUT_S, _get_json, _node_pid, _token_ids, _wait_until, start_2p2d
from tests.e2e.test_chaos import _post as chaos_post
from tests.e2e.test_up import _children, _kill_leftovers, _stop

FAULT_S = 25.0
BACK_WITHIN_S = 45.0
SLOW_S = 10.0
# Requests per phase allowed to fail or be slow: the ones in flight when the fault hits (one per worker), and the
# calls that meet the failing node before it is ejected (the proxy's --eject-after, 3).
A_FEW = 4 + 3
WORKERS = 4
STARTUP_S = 240.0
NUM_BODIES = 24
LEASE_S = 15           # a lease whose decode node died ends this soon (the pools drain in the test), yet outlives
                       # a decode call retried after a first-byte timeout (5 s)


@dataclass(frozen=True)
class Outcome:
    started: float
    seconds: float
    ok: bool
    detail: str


def _post(url: str, body: dict) -> tuple[int, bytes]:
    """The chaos test's call, with a connection that fails or times out as status 0 (a failed request here)."""
    try:
        return chaos_post(url, body)
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        return 0, str(exc).encode()


class Load:
    """WORKERS threads, each sending the next body as soon as its last answer came."""

    def __init__(self, proxy: str, bodies: list[dict], expected: list[list[int]]) -> None:
        self._proxy, self._bodies, self._expected = proxy, bodies, expected
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._next = 0
        self.outcomes: list[Outcome] = []
        self._threads = [threading.Thread(target=self._work, daemon=True) for _ in range(WORKERS)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(CLIENT_TIMEOUT_S + 10)

    def _work(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                i, self._next = self._next % len(self._bodies), self._next + 1
            body = self._bodies[i]
            start = time.monotonic()
            status, raw = _post(self._proxy, body)
            seconds = time.monotonic() - start
            ok, detail = False, f"HTTP {status}: {raw[:200]!r}"
            if status == 200:
                ids, error = _token_ids(raw, body["stream"])
                ok, detail = (ids == self._expected[i], "ok") if error is None else (False, error)
                if error is None and not ok:
                    raise AssertionError(f"request {i}: wrong tokens {ids} != {self._expected[i]}")
            with self._lock:
                self.outcomes.append(Outcome(started=start, seconds=seconds, ok=ok, detail=detail))

    def bad_during(self, began: float, ended: float) -> list[Outcome]:
        """Requests that failed or were slow and ended in [began, ended) (the phases' windows do not overlap)."""
        with self._lock:
            return [o for o in self.outcomes if began <= o.started + o.seconds < ended
                    and (not o.ok or o.seconds > SLOW_S)]

    def completed_since(self, since: float) -> int:
        with self._lock:
            return sum(o.ok for o in self.outcomes if o.started >= since)


def _all_in_rotation(proxy: str) -> bool:
    status, body = _get_json(proxy + "/health")
    return status == 200 and all(u["state"] == "healthy" and u.get("routing", {}).get("state") == "healthy"
                                 for u in body.get("upstreams", []))


def _engine_of(front: int) -> int:
    tree = process_tree(front)
    assert len(tree) == 2, f"a node is its front and one engine process: {tree}"
    return tree[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"))


def test_gray_failures_cost_a_few_requests_and_every_node_returns(tiny, tmp_path):
    up, proxy_port, nodes, ports = start_2p2d(
        tiny, tmp_path, [],
        ["--kv-load-timeout", "5", "--engine-heartbeat-timeout", "3", "--kv-lease-seconds", str(LEASE_S)])
    proxy = f"http://127.0.0.1:{proxy_port}"
    stopped: list[int] = []
    try:
        _wait_until(lambda: up.poll() is None and _all_in_rotation(proxy), "the cluster is up", STARTUP_S)
        rng = random.Random(11)
        bodies = [{"prompt": [rng.randrange(3, 250) for _ in range(rng.randrange(20, 120))], "max_tokens": 8,
                   "temperature": 0, "ignore_eos": True, "return_token_ids": True, "stream": i % 2 == 0}
                  for i in range(NUM_BODIES)]
        healthy = f"http://127.0.0.1:{nodes['decode-0']}"
        expected = [_token_ids(_post(healthy, {**b, "stream": False})[1], False)[0] for b in bodies]

        def stop_for(pid: int) -> None:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
            time.sleep(FAULT_S)
            os.kill(pid, signal.SIGCONT)
            stopped.remove(pid)

        def kill_engine(name: str) -> None:
            os.kill(_engine_of(_node_pid(nodes[name])), signal.SIGKILL)
            _wait_until(lambda: f"restarted {name}" in (tmp_path / "up.log").read_text(),
                        f"`up` restarts {name} once its front exits", 60)

        phases = {
            "decode front stopped": lambda: stop_for(_node_pid(nodes["decode-1"])),
            "prefill engine stopped": lambda: stop_for(_engine_of(_node_pid(nodes["prefill-1"]))),
            "decode engine killed": lambda: kill_engine("decode-0"),
        }
        windows = {}
        with Load(proxy, bodies, expected) as load:
            _wait_until(lambda: load.completed_since(0) >= 8, "the load runs", 60)
            for name, fault in phases.items():
                began = time.monotonic()
                fault()
                ended = time.monotonic()
                _wait_until(lambda: _all_in_rotation(proxy), f"{name}: every node back in rotation", BACK_WITHIN_S)
                _wait_until(lambda: load.completed_since(ended) >= 2 * WORKERS, f"{name}: requests complete", 60)
                windows[name] = (began, time.monotonic())
        report = {name: [f"{o.seconds:.1f}s {o.detail[:160]}" for o in load.bad_during(*window)]
                  for name, window in windows.items()}
        assert not load.bad_during(0, min(began for began, _ in windows.values())), "failures before any fault"
        print(json.dumps(report, indent=1))
        for name, bad in report.items():
            assert len(bad) <= A_FEW, (name, bad)
        assert load.completed_since(0) >= 40
        for port in nodes.values():
            view = NodeProcess(None, port, port + 1000, tmp_path / "unused.log")  # type: ignore[arg-type]
            assert_blocks_free(view, timeout=LEASE_S + 30)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        _stop(up)
        _kill_leftovers(_children(ports))
