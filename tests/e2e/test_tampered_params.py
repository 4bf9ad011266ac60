"""Tampered `kv_transfer_params` against a real prefill node and a real decode node.

Every tampered variant is refused: malformed values with a 400 before anything is read, well-formed lies with a
502 that names the prefill node and what did not match. The decode node trusts only the blocks that the prefill
node's heartbeat says are leased to that request id (never the ids in the body), so the prefill node never serves
bytes outside a live lease for that request. After each case no lease and no block is left behind, and when the
refusal came before any contact with the prefill node, the untampered params still work (the lease is intact).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hybridpd.presets.checkpoints import write_checkpoint
from tests.e2e.nodes import free_port
from tests.e2e.faults import (
    NODE_ARGS,
    NodeSlot,
    assert_clean,
    colocated_text,
    completion,
    error_message,
    metric,
    prompt,
    remote_prefill,
    start_all,
    stop_all,
    wait_for,
)

LEASE_S = 4.0

Params = dict[str, Any]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory) -> Iterator[tuple[Any, Any]]:
    model = write_checkpoint("tiny", tmp_path_factory.mktemp("tiny"))
    logs = tmp_path_factory.mktemp("logs")
    slots = [NodeSlot(model, logs, (*NODE_ARGS, "--kv-lease-seconds", str(LEASE_S)), "prefill"),
             NodeSlot(model, logs, NODE_ARGS, "decode")]
    try:
        yield tuple(start_all(slots))
    finally:
        stop_all(slots)


def _with(**fields: Any) -> Callable[[Params], Params]:
    return lambda params: {**params, **fields}


def _blocks(change: Callable[[list[list[int]]], Any]) -> Callable[[Params], Params]:
    def mutate(params: Params) -> Params:
        return {**params, "remote_block_ids": change(copy.deepcopy(params["remote_block_ids"]))}
    return mutate


def _longest_group(groups: list[list[int]]) -> int:
    return max(range(len(groups)), key=lambda g: len(groups[g]))


def _shift_one(groups: list[list[int]]) -> list[list[int]]:
    """Same shape, one id moved to a neighbouring block that is not leased to this request."""
    g = _longest_group(groups)
    groups[g][-1] = groups[g][-1] + 1 if groups[g][-1] + 1 not in groups[g] else max(groups[g]) + 1
    return groups


def _set_last(value: Any) -> Callable[[list[list[int]]], list[list[int]]]:
    def change(groups: list[list[int]]) -> list[list[int]]:
        groups[_longest_group(groups)][-1] = value
        return groups
    return change


# (case, mutation, expected status, a phrase the error message must contain)
REFUSED_BEFORE_ANY_READ = [
    ("negative block id", _blocks(_set_last(-1)), 400, "invalid block id"),
    ("huge block id", _blocks(_set_last(2**40)), 400, "invalid block id"),
    ("float block id", _blocks(_set_last(3.0)), 400, "invalid block id"),
    ("one group missing", _blocks(lambda groups: groups[:-1]), 400, "groups"),
    ("one block too many", _blocks(lambda groups: [*groups[:-1], [*groups[-1], 1]]), 400, "blocks"),
    ("flat block list", _blocks(lambda groups: [i for group in groups for i in group]), 400, "list of lists"),
    ("block ids as object", _with(remote_block_ids={"0": [1]}), 400, "list of lists"),
    ("port as string", _with(remote_port="7000"), 400, "remote_port must be an integer"),
    ("port out of range", _with(remote_port=70000), 400, "out of range"),
    ("engine id as number", _with(remote_engine_id=7), 400, "remote_engine_id must be a"),
    ("engine id empty", _with(remote_engine_id=""), 400, "remote_engine_id must be a non-empty string"),
    ("params not an object", lambda p: [p], 400, "kv_transfer_params must be an object"),
    ("request id missing", _with(remote_request_id=None), 400, "remote_request_id is required"),
    ("num tokens as float", _with(remote_num_tokens=1.5), 400, "remote_num_tokens must be an integer"),
    ("num tokens one short", lambda p: {**p, "remote_num_tokens": p["remote_num_tokens"] - 1}, 400,
     "but this prompt has"),
    ("first token missing", _with(first_token_id=None), 400, "first_token_id is required"),
    ("first token outside the vocabulary", _with(first_token_id=10**6), 400, "outside the vocabulary"),
    ("first token logprob of another token", lambda p: {**p, "first_token_logprob": {
        "token_id": p["first_token_id"] + 1, "logprob": -1.0, "top": []}}, 400, "first_token_logprob"),
    ("flag as string", _with(do_remote_prefill="true"), 400, "do_remote_prefill must be a boolean"),
    ("both directions", _with(do_remote_decode=True), 400, "cannot both be true"),
    ("lease expiry as string", _with(remote_lease_expiry="never"), 400, "remote_lease_expiry"),
]

REFUSED_BY_THE_LEASE = [
    ("wrong engine id", _with(remote_engine_id="hybridpd-000000000000"), "does not match the engine"),
    ("block outside the lease", _blocks(_shift_one), "do not match the blocks leased"),
    ("in-range id beyond the pool", _blocks(_set_last(2**31 - 1)), "out of range"),   # refused before any READ
    ("unknown request id", _with(remote_request_id="cmpl-not-a-request"), "no lease is held"),
]


def _decode(node: Any, body: dict[str, Any], params: Params) -> tuple[int, dict[str, Any]]:
    return node.post_json("/v1/completions", {**body, "kv_transfer_params": params})


@pytest.mark.parametrize("case, mutate, status, phrase", REFUSED_BEFORE_ANY_READ,
                         ids=[row[0] for row in REFUSED_BEFORE_ANY_READ])
def test_malformed_params_are_a_400_and_leave_the_lease_intact(nodes, case, mutate, status, phrase):
    prefill, decode = nodes
    body = completion(prompt(f"malformed {case}"))
    params = remote_prefill(prefill, body)
    code, answer = _decode(decode, body, mutate(params))
    assert code == status, answer
    assert phrase in error_message(answer) and answer["error"]["param"].startswith("kv_transfer_params"), answer
    code, answer = _decode(decode, body, params)  # the honest decoder still gets the KV
    assert code == 200, answer
    assert answer["choices"][0]["text"] == colocated_text(prefill, body)
    assert_clean(prefill, decode)


@pytest.mark.parametrize("case, mutate, phrase", REFUSED_BY_THE_LEASE, ids=[row[0] for row in REFUSED_BY_THE_LEASE])
def test_params_that_disagree_with_the_lease_fail_naming_the_prefill_node(nodes, case, mutate, phrase):
    prefill, decode = nodes
    body = completion(prompt(f"lease {case}"))
    params = remote_prefill(prefill, body)
    failed_before = metric(decode, "hybridpd:kv_failed_loads_total")
    code, answer = _decode(decode, body, mutate(params))
    assert code == 502, answer
    message = error_message(answer)
    assert f"{params['remote_host']}:{params['remote_port']}" in message and phrase in message, message
    assert metric(decode, "hybridpd:kv_failed_loads_total") == failed_before + 1
    assert_clean(prefill, decode)  # the decoder released (aborted) the lease it refused to read, or it expired


def test_blocks_leased_to_another_request_are_refused(nodes):
    """Request A's id with request B's block ids (both leases live, same shape): nothing is read."""
    prefill, decode = nodes
    body_a, body_b = completion(prompt("other lease A")), completion(prompt("other lease B"))
    params_a, params_b = remote_prefill(prefill, body_a), remote_prefill(prefill, body_b)
    assert params_a["remote_block_ids"] != params_b["remote_block_ids"]
    code, answer = _decode(decode, body_a, {**params_a, "remote_block_ids": params_b["remote_block_ids"]})
    assert code == 502 and "do not match the blocks leased" in error_message(answer), answer
    code, answer = _decode(decode, body_b, params_b)  # B's lease was untouched by A's refusal
    assert code == 200, answer
    assert_clean(prefill, decode)


def test_replayed_params_fail_after_the_first_decode_released_the_lease(nodes):
    prefill, decode = nodes
    body = completion(prompt("replay"))
    params = remote_prefill(prefill, body)
    code, first = _decode(decode, body, params)
    assert code == 200, first
    code, answer = _decode(decode, body, params)
    assert code == 502, answer
    assert "already released" in error_message(answer), answer
    assert_clean(prefill, decode)


def test_expired_lease_fails_with_expired(nodes):
    prefill, decode = nodes
    body = completion(prompt("expired"))
    expired_before = metric(prefill, "hybridpd:kv_leases_expired_total")
    params = remote_prefill(prefill, body)
    wait_for(lambda: metric(prefill, "hybridpd:kv_leases_expired_total") > expired_before, "the lease to expire")
    code, answer = _decode(decode, body, params)
    assert code == 502, answer
    assert "expired" in error_message(answer) and str(params["remote_port"]) in error_message(answer), answer
    assert_clean(prefill, decode)


def test_side_channel_port_that_nobody_listens_on_fails_fast_naming_it(nodes):
    prefill, decode = nodes
    body = completion(prompt("closed port"))
    params = remote_prefill(prefill, body)
    closed = free_port()
    code, answer = _decode(decode, body, {**params, "remote_port": closed})
    assert code == 502, answer
    assert f"127.0.0.1:{closed}" in error_message(answer) and "unreachable" in error_message(answer), answer
    assert_clean(prefill, decode)  # the prefill node's own lease ends by expiry


def test_a_live_lease_cannot_be_read_for_another_prompt(nodes):
    """Request A's own params (live lease, right ids) sent with prompt B of the same length: the lease is tied
    to A's tokens (the heartbeat carries their digest), so B never gets A's KV."""
    prefill, decode = nodes
    body_a = completion(prompt("digest A"))
    body_b = completion(prompt("digest B"))
    assert len(body_a["prompt"]) == len(body_b["prompt"])
    params_a = remote_prefill(prefill, body_a)
    code, answer = _decode(decode, body_b, params_a)
    assert code == 502 and "prefilled for another prompt" in error_message(answer), answer
    assert_clean(prefill, decode)


def test_another_requests_params_without_its_lease_secret_cannot_end_its_lease(nodes):
    """Only the holder of a lease may renew or release it: a request carrying this request's id but not its
    `remote_lease_secret` is refused, and the refusal's Release does not end the holder's lease."""
    prefill, decode = nodes
    body = completion(prompt("holder of the lease"))
    params = remote_prefill(prefill, body)
    assert isinstance(params["remote_lease_secret"], str) and len(params["remote_lease_secret"]) == 32
    tampered = [
        {**params, "remote_lease_secret": None},                                   # no secret: heartbeat refused
        {**params, "remote_lease_secret": "0" * 32},                               # a guess: heartbeat refused
        {**params, "remote_engine_id": "hybridpd-000000000000", "remote_lease_secret": "x" * 32},  # refused early
    ]
    for params_of_another in tampered:
        code, answer = _decode(decode, body, params_of_another)
        assert code == 502, answer
    code, answer = _decode(decode, body, params)  # the holder still pulls and decodes
    assert code == 200, answer
    assert answer["choices"][0]["text"] == colocated_text(prefill, body)
    assert_clean(prefill, decode)
