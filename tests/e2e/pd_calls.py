"""vLLM's toy proxy, as the test_pd_* files drive two real nodes with it (this module holds no tests itself).

Step 1: POST the prefill node the request with `max_tokens: 1`, `stream: false` and the `do_remote_decode`
params; it answers its first token and top-level `kv_transfer_params`. Step 2: POST the decode node the original request plus those
params. Also: start several nodes at once (start-up dominates these files' wall time), read SSE token ids, and
wait for a metric without timing anything.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.e2e.nodes import NodeProcess, assert_blocks_free, start_node

REQUEST_TIMEOUT_S = 120.0
METRIC_TIMEOUT_S = 60.0

REMOTE_DECODE_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}


@dataclass(frozen=True, kw_only=True)
class StreamedAnswer:
    token_ids: tuple[int, ...]
    usage: dict[str, Any]
    finish_reason: str | None


def greedy_body(prompt: Sequence[int], max_tokens: int = 8) -> dict[str, Any]:
    """A token-id prompt, greedy, a fixed number of output tokens, ids in the answer."""
    return {"prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}


def start_nodes(model_dir: Path, log_dir: Path, args_by_name: Mapping[str, Sequence[str]]) -> dict[str, NodeProcess]:
    """Start every node concurrently; if any fails to start, stop the ones that did and re-raise."""
    with ThreadPoolExecutor(len(args_by_name)) as pool:
        futures = {name: pool.submit(start_node, model_dir, log_dir, args, name=name)
                   for name, args in args_by_name.items()}
    started, errors = {}, []
    for name, future in futures.items():
        try:
            started[name] = future.result()
        except Exception as exc:  # collected: every started node must still be stopped
            errors.append(exc)
    if errors:
        stop_all(started.values())
        raise errors[0]
    return started


def stop_all(nodes: Iterable[NodeProcess]) -> None:
    """SIGTERM every node at once (each waits out its own shutdown grace), killing any that does not exit."""
    nodes = list(nodes)
    if nodes:
        with ThreadPoolExecutor(len(nodes)) as pool:
            list(pool.map(NodeProcess.stop, nodes))


def colocated_token_ids(node: NodeProcess, body: Mapping[str, Any]) -> list[int]:
    status, answer = node.post_json("/v1/completions", dict(body), timeout=REQUEST_TIMEOUT_S)
    assert status == 200, answer
    return answer["choices"][0]["token_ids"]


def prefill_call(prefill: NodeProcess, body: Mapping[str, Any]) -> dict[str, Any]:
    """Step 1; returns the top-level `kv_transfer_params` of the prefill node's answer."""
    status, answer = prefill.post_json("/v1/completions", {
        **body, "max_tokens": 1, "stream": False, "kv_transfer_params": dict(REMOTE_DECODE_PARAMS)},
        timeout=REQUEST_TIMEOUT_S)
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_num_tokens"] == len(body["prompt"]), params
    if body.get("return_token_ids"):  # the first token is the prefill node's answer, and what the decoder goes on from
        assert answer["choices"][0]["token_ids"] == [params["first_token_id"]], (answer, params)
    return params


def decode_call(decode: NodeProcess, body: Mapping[str, Any], params: Mapping[str, Any]) -> tuple[int, dict]:
    """Step 2, not streamed: (HTTP status, answer)."""
    return decode.post_json("/v1/completions", {**body, "kv_transfer_params": dict(params)},
                            timeout=REQUEST_TIMEOUT_S)


def decode_call_streamed(decode: NodeProcess, body: Mapping[str, Any], params: Mapping[str, Any]) -> StreamedAnswer:
    """Step 2 with `stream: true` and usage: the token ids of every SSE chunk, in order."""
    request = urllib.request.Request(
        decode.url + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
        data=json.dumps({**body, "stream": True, "stream_options": {"include_usage": True},
                         "kv_transfer_params": dict(params)}).encode())
    token_ids, usage, finish_reason, done = [], {}, None, False
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        assert response.status == 200
        for raw in response:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            for choice in event.get("choices", []):
                token_ids.extend(choice.get("token_ids", []))
                finish_reason = choice.get("finish_reason") or finish_reason
            usage = event.get("usage") or usage
    assert done, "the stream ended without [DONE]"
    return StreamedAnswer(token_ids=tuple(token_ids), usage=usage, finish_reason=finish_reason)


def pd_token_ids(prefill: NodeProcess, decode: NodeProcess, body: Mapping[str, Any]) -> tuple[list[int], dict]:
    """Both steps; returns the decode node's token ids and its usage."""
    status, answer = decode_call(decode, body, prefill_call(prefill, body))
    assert status == 200, answer
    return answer["choices"][0]["token_ids"], answer["usage"]


def metric_total(node: NodeProcess, name: str) -> float:
    """The sum over every label set (0 when the metric has no sample yet)."""
    return sum(node.metric_values(name).values())


def wait_for_metric(node: NodeProcess, name: str, at_least: float, timeout: float = METRIC_TIMEOUT_S) -> float:
    """Poll /metrics until `name` (summed over labels) reaches `at_least`; returns its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = metric_total(node, name)
        if value >= at_least:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} on {node.url} stayed at {value} (< {at_least}):\n{node.log_tail()}")
        time.sleep(0.1)


def wait_for_metric_at_most(node: NodeProcess, name: str, at_most: float,
                            timeout: float = METRIC_TIMEOUT_S) -> float:
    """Poll /metrics until `name` (summed over labels) falls to `at_most`; returns its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = metric_total(node, name)
        if value <= at_most:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} on {node.url} stayed at {value} (> {at_most}):\n{node.log_tail()}")
        time.sleep(0.05)


def assert_drained(*nodes: NodeProcess) -> None:
    """Every block back in the pool and no lease held, on every node given."""
    for node in nodes:
        assert_blocks_free(node)
        assert metric_total(node, "hybridpd:kv_leases_held") == 0, node.metrics()
