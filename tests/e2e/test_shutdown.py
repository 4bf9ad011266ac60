"""Graceful shutdown on SIGTERM, on real `hybridpd serve` processes (tiny checkpoint).

- A node with a long stream in flight: the stream ends (finished or aborted, with `[DONE]`, never hung), a new
  request during the drain gets 503 (or, once the node is gone, connection refused), and the process exits 0.
- A prefill node holding a lease that nobody pulls: it waits out the grace, releases the lease, exits 0.
- A prefill node holding a lease that a decode node pulls during the drain: the decode request succeeds with
  the colocated answer and the prefill node exits 0 with no lease left to release (the decoder released it).

Exits are waited for with a deadline (grace + a margin for a loaded machine), never asserted on time.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from hybridpd.presets.checkpoints import write_checkpoint
from tests.e2e.nodes import NodeProcess, start_node

GRACE_S = 2.0
EXIT_MARGIN_S = 60.0
NODE_ARGS = ["--num-blocks", "128", "--max-model-len", "2048"]
PROMPT = "Graceful shutdown lets the decoder finish reading this prompt. " * 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_checkpoint("tiny", tmp_path_factory.mktemp("model"))


@pytest.fixture
def nodes(model_dir, tmp_path):
    """Starts nodes on demand; kills every one of them at the end, whatever happened."""
    started: list[NodeProcess] = []

    def start(*args: str, name: str) -> NodeProcess:
        node = start_node(model_dir, tmp_path, [*NODE_ARGS, *args], name=name)
        started.append(node)
        return node

    try:
        yield start
    finally:
        for node in started:
            node.kill()


def wait_exit(node: NodeProcess, grace: float) -> int:
    try:
        return node.proc.wait(timeout=grace + EXIT_MARGIN_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the node did not exit within the grace + {EXIT_MARGIN_S:g} s:\n{node.log_tail()}")


def post_status(node: NodeProcess, body: dict) -> int | str:
    """The HTTP status of a POST, or "refused" when nothing listens any more."""
    try:
        return node.post_json("/v1/completions", body, timeout=30)[0]
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            return "refused"
        raise
    except ConnectionError:
        return "refused"


def wait_draining(node: NodeProcess, timeout: float = 60.0) -> None:
    """Polls /health (with a deadline) until the node says it is draining or stops answering."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            node.get_json("/health", timeout=5)
        except urllib.error.HTTPError as exc:
            if exc.code == 503:
                return
        except (urllib.error.URLError, ConnectionError):
            return
        if node.proc.poll() is not None:
            return
        time.sleep(0.05)
    raise AssertionError(f"the node never started draining after SIGTERM:\n{node.log_tail()}")


async def _stream_through_sigterm(node: NodeProcess) -> tuple[list[str], int | str]:
    body = {"prompt": "a long answer", "max_tokens": 1900, "ignore_eos": True, "stream": True, "temperature": 0}
    timeout = aiohttp.ClientTimeout(total=GRACE_S + EXIT_MARGIN_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(node.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            events = [(await resp.content.readline()).decode().strip()]
            node.proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(wait_draining, node)
            during_drain = await asyncio.to_thread(post_status, node, {"prompt": "late", "max_tokens": 2})
            async for raw in resp.content:
                if raw.strip():
                    events.append(raw.decode().strip())
    return events, during_drain


def test_sigterm_ends_a_running_stream_refuses_new_requests_and_exits_zero(nodes):
    node = nodes("--shutdown-grace", str(GRACE_S), name="streaming")
    events, during_drain = asyncio.run(_stream_through_sigterm(node))
    assert during_drain in (503, "refused")
    assert events[-1] == "data: [DONE]", events[-3:]
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] in ("abort", "length")
    assert wait_exit(node, GRACE_S) == 0, node.log_tail()
    assert "request(s) aborted" in node.log_path.read_text()


def _prefill(node: NodeProcess) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 1, "stream": False, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}}
    status, answer = node.post_json("/v1/completions", body)
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    assert params["remote_lease_expiry"] is not None
    assert node.metric_values("hybridpd:kv_leases_held") == {"": 1.0}
    return params


def test_prefill_node_with_an_unpulled_lease_releases_it_and_exits_zero(nodes):
    prefill = nodes("--shutdown-grace", str(GRACE_S), name="prefill-unpulled")
    _prefill(prefill)
    prefill.proc.send_signal(signal.SIGTERM)
    assert wait_exit(prefill, GRACE_S) == 0, prefill.log_tail()
    assert "0 request(s) aborted, 1 lease(s) released at shutdown" in prefill.log_path.read_text()


def test_decoder_pulls_from_a_draining_prefill_node_which_then_exits_zero(nodes):
    grace = 120.0  # long: the node must leave as soon as the decoder released its lease, not at the grace's end
    prefill = nodes("--shutdown-grace", str(grace), name="prefill-draining")
    decode = nodes(name="decode")
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    params = _prefill(prefill)
    prefill.proc.send_signal(signal.SIGTERM)
    wait_draining(prefill)
    status, answer = decode.post_json("/v1/completions", {**body, "kv_transfer_params": params})
    assert status == 200, answer
    assert wait_exit(prefill, grace) == 0, prefill.log_tail()
    assert "0 request(s) aborted, 0 lease(s) released at shutdown" in prefill.log_path.read_text()
    status, local = decode.post_json("/v1/completions", body)
    assert status == 200, local
    assert answer["choices"][0]["token_ids"] == local["choices"][0]["token_ids"]
