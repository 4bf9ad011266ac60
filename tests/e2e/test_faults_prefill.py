"""Fault matrix, prefill side: the prefill node dies before, during or after the decode node's
pull; its side channel is a closed port; it serves another checkpoint. Two decode nodes stay up the whole module,
one with `--kv-load-failure-policy fail` (a 502 naming the prefill node and what failed) and one with `recompute`
(the greedy answer of a colocated run); the prefill node is restarted after each kill.

"During" is made deterministic with SIGSTOP: the prefill node is frozen after it answered, the decode requests are
sent, the test waits until the decode node reports them WAITING_FOR_REMOTE_KV (the pull has begun and a side
channel call to the frozen node is outstanding), then kills it. A kill that lands inside the NIXL READ itself
takes the same road: `DecodeRole._wait_read` sees the transfer FAILED or its lease renewal fail, raises
KVTransferError, and `_failed` applies the policy; the READ wrote only into the decoder's own, still-allocated
blocks, which are freed (fail) or overwritten by the local prefill (recompute), never served.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from hybridpd.presets.checkpoints import write_checkpoint
from tests.e2e.nodes import NodeProcess, free_port
from tests.e2e.faults import (
    NODE_ARGS,
    PULLING,
    REQUEST_TIMEOUT_S,
    NodeSlot,
    assert_clean,
    colocated_text,
    completion,
    error_message,
    frozen,
    metric,
    prompt,
    remote_prefill,
    start_all,
    stop_all,
    wait_for,
)

LEASE_S = "3"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_checkpoint("tiny", tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def slots(model, logs) -> Iterator[dict[str, NodeSlot]]:
    slots = {
        "prefill": NodeSlot(model, logs, (*NODE_ARGS, "--kv-lease-seconds", LEASE_S), "prefill"),
        "fail": NodeSlot(model, logs, (*NODE_ARGS, "--kv-load-failure-policy", "fail"), "decode-fail"),
        "recompute": NodeSlot(model, logs, (*NODE_ARGS, "--kv-load-failure-policy", "recompute"), "decode-recompute"),
    }
    try:
        start_all(slots.values())
        yield slots
    finally:
        stop_all(slots.values())


def _decode(node: NodeProcess, body: dict[str, Any], params: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return node.post_json("/v1/completions", {**body, "kv_transfer_params": params}, timeout=REQUEST_TIMEOUT_S)


def _peer(params: dict[str, Any]) -> str:
    return f"{params['remote_host']}:{params['remote_port']}"


def _check_outcomes(slots: dict[str, NodeSlot], cases: dict[str, tuple[dict, dict, tuple[int, dict]]],
                    reason: str) -> None:
    """`fail` answered a 502 naming the prefill node and `reason`; `recompute` answered the colocated text."""
    body, params, (code, answer) = cases["fail"]
    assert code == 502, answer
    assert _peer(params) in error_message(answer) and reason in error_message(answer), answer
    body, params, (code, answer) = cases["recompute"]
    assert code == 200, answer
    assert answer["choices"][0]["text"] == colocated_text(slots["recompute"].get(), body)


def test_prefill_killed_before_the_read(slots):
    prefill = slots["prefill"].get()
    cases = {}
    for policy in ("fail", "recompute"):
        body = completion(prompt(f"killed before {policy}"))
        cases[policy] = (body, remote_prefill(prefill, body))
    slots["prefill"].kill()
    outcomes = {policy: (body, params, _decode(slots[policy].get(), body, params))
                for policy, (body, params) in cases.items()}
    _check_outcomes(slots, outcomes, "unreachable")
    assert_clean(slots["fail"].get(), slots["recompute"].get())


def test_prefill_killed_during_the_pull(slots):
    prefill = slots["prefill"].get()
    bodies = {policy: completion(prompt(f"killed during {policy}")) for policy in ("fail", "recompute")}
    params = {policy: remote_prefill(prefill, body) for policy, body in bodies.items()}
    with ThreadPoolExecutor(2) as pool, frozen(prefill):
        futures = {policy: pool.submit(_decode, slots[policy].get(), bodies[policy], params[policy])
                   for policy in bodies}
        for policy in bodies:
            node = slots[policy].get()
            wait_for(lambda n=node: metric(n, PULLING) == 1,
                     f"the {policy} decode node to start pulling")
        slots["prefill"].kill()
        outcomes = {policy: (bodies[policy], params[policy], futures[policy].result()) for policy in bodies}
    _check_outcomes(slots, outcomes, "side channel")
    assert_clean(slots["fail"].get(), slots["recompute"].get())


def test_prefill_killed_after_the_read(slots):
    prefill, decode = slots["prefill"].get(), slots["fail"].get()
    body = completion(prompt("killed after"), max_tokens=24)
    params = remote_prefill(prefill, body)
    code, answer = _decode(decode, body, params)
    assert code == 200, answer
    wait_for(lambda: metric(prefill, "hybridpd:kv_leases_held") == 0, "the decoder's release")
    slots["prefill"].kill()
    assert answer["choices"][0]["text"] == colocated_text(decode, body)
    assert_clean(decode)


def test_side_channel_port_closed_is_recomputed_under_recompute(slots):
    prefill, decode = slots["prefill"].get(), slots["recompute"].get()
    body = completion(prompt("closed port recompute"))
    params = remote_prefill(prefill, body)
    code, answer = _decode(decode, body, {**params, "remote_port": free_port()})
    assert code == 200, answer
    assert answer["choices"][0]["text"] == colocated_text(decode, body)
    assert_clean(prefill, decode)  # the prefill node's lease, never read, ends by expiry


@pytest.fixture
def other_prefill(model, logs, tmp_path) -> Iterator[NodeProcess]:
    """A prefill node serving another checkpoint of the same shape (its config differs in rope_theta)."""
    other = tmp_path / "tiny-other"
    other.mkdir()
    config = json.loads((model / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rope_theta": 20000.0}, indent=2))
    for path in model.iterdir():  # the same weights and tokenizer files
        if path.name != "config.json":
            (other / path.name).symlink_to(path)
    slot = NodeSlot(other, logs, (*NODE_ARGS, "--kv-lease-seconds", LEASE_S), "prefill-other")
    try:
        yield slot.get()
    finally:
        slot.stop()


def test_compatibility_mismatch_names_what_differs(slots, other_prefill):
    cases = {}
    for policy in ("fail", "recompute"):
        body = completion(prompt(f"other checkpoint {policy}"))
        params = remote_prefill(other_prefill, body)
        cases[policy] = (body, params, _decode(slots[policy].get(), body, params))
    _check_outcomes(slots, cases, "incompatible nodes: model differs: local config-sha256:")
    assert_clean(other_prefill, slots["fail"].get(), slots["recompute"].get())
