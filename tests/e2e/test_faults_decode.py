"""Fault matrix, decode side: the decode node dies while pulling and while decoding, and a
lease expires while the decode request is still queued (the decode node frozen meanwhile, so that its running
request cannot end first on a fast machine). The prefill node (2 s leases) stays up; the decode node
(`--max-num-seqs 1`, policy `fail`) is restarted after each kill.

"While pulling" is deterministic with SIGSTOP: the prefill node is frozen, the decode request sent, the test waits
until the decode node reports it WAITING_FOR_REMOTE_KV (its pull has a side-channel call outstanding to the frozen
node), kills the decode node, then thaws the prefill node. A kill inside the NIXL READ leaves the prefill node in
the same state (a lease nobody renews or releases), so the same expiry frees the blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from hybridpd.presets.checkpoints import write_checkpoint
from tests.e2e.faults import (
    NODE_ARGS,
    PULLING,
    REQUEST_TIMEOUT_S,
    NodeSlot,
    StreamingClient,
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

EXPIRED = "hybridpd:kv_leases_expired_total"


@pytest.fixture(scope="module")
def slots(tmp_path_factory) -> Iterator[dict[str, NodeSlot]]:
    model = write_checkpoint("tiny", tmp_path_factory.mktemp("tiny"))
    logs = tmp_path_factory.mktemp("logs")
    slots = {
        "prefill": NodeSlot(model, logs, (*NODE_ARGS, "--kv-lease-seconds", "2"), "prefill"),
        "decode": NodeSlot(model, logs, (*NODE_ARGS, "--max-num-seqs", "1"), "decode"),
    }
    try:
        start_all(slots.values())
        yield slots
    finally:
        stop_all(slots.values())


def test_decode_killed_while_pulling_lets_the_lease_expire(slots):
    prefill, decode = slots["prefill"].get(), slots["decode"].get()
    body = completion(prompt("decode killed pulling"))
    params = remote_prefill(prefill, body)
    expired = metric(prefill, EXPIRED)
    with ThreadPoolExecutor(1) as pool:
        with frozen(prefill):
            future = pool.submit(decode.post_json, "/v1/completions", {**body, "kv_transfer_params": params},
                                 REQUEST_TIMEOUT_S)
            wait_for(lambda: metric(decode, PULLING) == 1,
                     "the decode node to start pulling")
            slots["decode"].kill()
        with pytest.raises(OSError):  # the connection died with the node: no answer at all, never a stale one
            future.result()
    wait_for(lambda: metric(prefill, EXPIRED) == expired + 1, "the orphaned lease to expire")
    assert_clean(prefill)


def test_decode_killed_while_decoding_released_the_lease_before(slots):
    prefill, decode = slots["prefill"].get(), slots["decode"].get()
    body = completion(prompt("decode killed decoding"), max_tokens=3000, stream=True)
    params = remote_prefill(prefill, {**body, "stream": False})
    expired = metric(prefill, EXPIRED)
    client = StreamingClient(decode.port, "/v1/completions", {**body, "kv_transfer_params": params})
    client.send()
    client.read_events(2)  # decoding: the pull is over, so the lease was released, not left to expire
    slots["decode"].kill()
    client.disconnect()
    assert_clean(prefill)
    assert metric(prefill, EXPIRED) == expired


def test_lease_expiring_while_the_decode_request_is_queued_fails_it_clearly(slots):
    prefill, decode = slots["prefill"].get(), slots["decode"].get()
    hog = StreamingClient(decode.port, "/v1/completions", completion("hog", max_tokens=3000, stream=True))
    hog.send()
    hog.read_events(1)  # running: with --max-num-seqs 1 the decode request below must wait
    body = completion(prompt("queued past its lease"))
    expired = metric(prefill, EXPIRED)
    params = remote_prefill(prefill, body)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(decode.post_json, "/v1/completions", {**body, "kv_transfer_params": params},
                             REQUEST_TIMEOUT_S)
        try:
            wait_for(lambda: metric(decode, "vllm:num_requests_waiting") == 1, "the decode request to queue")
            with frozen(decode):  # the hog cannot end (and admit the queued request) however fast the machine
                wait_for(lambda: metric(prefill, EXPIRED) == expired + 1, "the queued request's lease to expire")
        finally:
            hog.disconnect()  # the hog is aborted: the queued request runs, and finds its lease gone
        code, answer = future.result()
    assert code == 502, answer
    message = error_message(answer)
    assert f"{params['remote_host']}:{params['remote_port']}" in message and "expired" in message, message
    assert_clean(prefill, decode)
    assert colocated_text(decode, body) != ""  # the decode node still serves
