"""P/D failures with real nodes: a decoder that never reads, and a prefill node that dies before the read.

(a) The prefill node runs with `--kv-lease-seconds 2`; only the prefill call is made. The lease expires, the
    blocks go back to the pool, and a late decode call with those params is an HTTP 502 `kv_transfer_error` that
    names the peer and says the lease is gone: never a 200, never stale data.
(b) The prefill node is killed after its prefill call answered and before the decode call. Killing it *during* a
    READ cannot be timed from outside (a READ of a few KB takes microseconds); what a decoder meets is the same
    in both cases: its side channel is unreachable, and a READ in flight fails the same way (policy `fail`: a 502
    naming the peer; policy `recompute`: the decoder prefills the prompt itself and answers correctly).
In every case the surviving nodes' blocks come back to the pool.
"""

from __future__ import annotations

import random

import pytest
import torch

from hybridpd.presets.checkpoints import write_checkpoint
from tests.e2e.pd_calls import (
    assert_drained,
    colocated_token_ids,
    decode_call,
    greedy_body,
    metric_total,
    prefill_call,
    start_nodes,
    stop_all,
    wait_for_metric,
    wait_for_metric_at_most,
)

LEASE_SECONDS = "2"
COMMON = ("--kv-cache-memory", "64MiB", "--max-model-len", "512")
DECODE_ARGS = (*COMMON, "--kv-load-timeout", "10")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    torch.set_num_threads(1)
    model_dir = write_checkpoint("tiny", tmp_path_factory.mktemp("tiny"))
    started = start_nodes(model_dir, tmp_path_factory.mktemp("logs"), {
        "short-lease": (*COMMON, "--kv-lease-seconds", LEASE_SECONDS),
        "doomed": COMMON,
        "fail": DECODE_ARGS,
        "recompute": (*DECODE_ARGS, "--kv-load-failure-policy", "recompute"),
    })
    try:
        yield started
    finally:
        stop_all(started.values())


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def _peer(params: dict) -> str:
    return f"{params['remote_host']}:{params['remote_port']}"


def _assert_kv_transfer_error(status: int, answer: dict, peer: str, *fragments: str) -> None:
    assert status == 502, answer
    error = answer["error"]
    assert error["type"] == "kv_transfer_error" and error["code"] == 502, error
    assert peer in error["message"], error
    for fragment in fragments:
        assert fragment in error["message"], error
    assert "choices" not in answer


def test_a_late_read_after_the_lease_expired_fails_cleanly(nodes):
    prefill, decode = nodes["short-lease"], nodes["fail"]
    body = greedy_body(_prompt(50, seed=100))
    expired_before = metric_total(prefill, "hybridpd:kv_leases_expired_total")
    failed_before = metric_total(decode, "hybridpd:kv_failed_loads_total")

    params = prefill_call(prefill, body)
    wait_for_metric(prefill, "hybridpd:kv_leases_expired_total", expired_before + 1)
    assert_drained(prefill)
    status, answer = decode_call(decode, body, params)

    _assert_kv_transfer_error(status, answer, _peer(params), "lease", "expired")
    assert metric_total(decode, "hybridpd:kv_failed_loads_total") == failed_before + 1
    assert_drained(prefill, decode)


def test_a_late_read_with_policy_recompute_recomputes_instead_of_reading(nodes):
    """The expired lease's blocks may hold anything by now: the decoder must compute the prompt itself."""
    prefill, decode = nodes["short-lease"], nodes["recompute"]
    body = greedy_body(_prompt(50, seed=101))
    expected = colocated_token_ids(prefill, body)
    expired_before = metric_total(prefill, "hybridpd:kv_leases_expired_total")
    bytes_before = metric_total(decode, "hybridpd:kv_bytes_read_total")

    params = prefill_call(prefill, body)
    wait_for_metric(prefill, "hybridpd:kv_leases_expired_total", expired_before + 1)
    status, answer = decode_call(decode, body, params)

    assert status == 200, answer
    assert answer["choices"][0]["token_ids"] == expected
    assert metric_total(decode, "hybridpd:kv_bytes_read_total") == bytes_before
    assert_drained(prefill, decode)


def test_a_lease_nobody_took_is_released_by_its_holder_only(nodes):
    """`POST /kv_leases/release` (what the proxy calls when no decode node took a request): without the lease's
    secret it is refused or changes nothing; with it, the blocks go back to the pool at once, not at expiry."""
    prefill = nodes["fail"]
    params = prefill_call(prefill, greedy_body(_prompt(60, seed=200)))
    assert metric_total(prefill, "hybridpd:kv_leases_held") == 1
    status, answer = prefill.post_json("/kv_leases/release", {"remote_request_id": params["remote_request_id"]})
    assert status == 400 and "remote_lease_secret" in answer["error"]["message"], answer
    wrong = {"remote_request_id": params["remote_request_id"], "remote_lease_secret": "not-the-secret"}
    assert prefill.post_json("/kv_leases/release", wrong)[0] == 202
    # the scrape travels the engine link after the release, so it sees the release's outcome: none
    assert metric_total(prefill, "hybridpd:kv_leases_held") == 1
    right = {**wrong, "remote_lease_secret": params["remote_lease_secret"]}
    assert prefill.post_json("/kv_leases/release", right)[0] == 202
    wait_for_metric_at_most(prefill, "hybridpd:kv_leases_held", 0)
    assert metric_total(prefill, "hybridpd:kv_leases_expired_total") == 0   # released, not expired
    assert_drained(prefill)


@pytest.fixture(scope="module")
def orphaned(nodes) -> dict[str, tuple[dict, dict, list[int]]]:
    """Per decoder: (request body, params from the prefill node that is then killed, colocated output computed
    beforehand on another node)."""
    doomed, reference = nodes["doomed"], nodes["short-lease"]
    out = {}
    for i, decoder in enumerate(("fail", "recompute")):
        body = greedy_body(_prompt(70, seed=500 + i))
        out[decoder] = (body, prefill_call(doomed, body), colocated_token_ids(reference, body))
    doomed.kill()
    return out


def test_prefill_node_killed_policy_fail_is_a_502_naming_the_peer(nodes, orphaned):
    body, params, _ = orphaned["fail"]
    status, answer = decode_call(nodes["fail"], body, params)
    _assert_kv_transfer_error(status, answer, _peer(params), "unreachable")
    assert_drained(nodes["fail"])


def test_prefill_node_killed_policy_recompute_finishes_correctly(nodes, orphaned):
    body, params, expected = orphaned["recompute"]
    failed_before = metric_total(nodes["recompute"], "hybridpd:kv_failed_loads_total")
    status, answer = decode_call(nodes["recompute"], body, params)
    assert status == 200, answer
    assert answer["choices"][0]["token_ids"] == expected
    assert metric_total(nodes["recompute"], "hybridpd:kv_failed_loads_total") == failed_before + 1
    assert_drained(nodes["recompute"])
