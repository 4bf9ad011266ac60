"""P/D correctness with two real nodes: greedy tokens through prefill-then-decode (driven as vLLM's toy proxy
does) equal colocated tokens, for prompt lengths around the block size, prompts longer than every window,
8 requests in flight at once, and a streamed decode call; seeded sampling and logprobs equal colocated too, and so
do vLLM's logits processors (penalties, min_p, logit_bias, min_tokens) and stop token ids; a request its first token
ends pulls nothing. After each scenario both nodes hold no lease and have
every block back in the pool. One node may also take both roles of a request (it pulls from itself).

The tiny preset has windows 5 and 11 and Mamba chunk 8; it runs at block size 16 (windows inside one or two
blocks) and 4 (windows spanning several blocks, some freed to the null block as they slide out).

The colocated reference comes from the prefill node (same checkpoint and flags as the decode node), asked before
the P/D run; the decode node never saw the prompt, so its hit is 0 and it pulls everything it needs.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hybridpd.presets.checkpoints import write_checkpoint
from tests.e2e.pd_calls import (
    assert_drained,
    colocated_token_ids,
    decode_call,
    decode_call_streamed,
    greedy_body,
    metric_total,
    pd_token_ids,
    prefill_call,
    start_nodes,
    stop_all,
    wait_for_metric_at_most,
)

LARGEST_WINDOW = 11
IN_FLIGHT = 8
BARRIER_TIMEOUT_S = 120.0
NODE_ARGS = ("--kv-cache-memory", "64MiB", "--max-model-len", "512", "--kv-load-timeout", "10")


@pytest.fixture(scope="module", params=[16, 4], ids=lambda bs: f"block{bs}")
def pair(request, tmp_path_factory):
    torch.set_num_threads(1)
    block_size = request.param
    model_dir = write_checkpoint("tiny", tmp_path_factory.mktemp("tiny"))
    args = (*NODE_ARGS, "--block-size", str(block_size))
    nodes = start_nodes(model_dir, tmp_path_factory.mktemp("logs"), {"prefill": args, "decode": args})
    try:
        yield nodes["prefill"], nodes["decode"], block_size
    finally:
        stop_all(nodes.values())


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def _lengths(block_size: int) -> dict[str, int]:
    return {
        "one": 1, "two": 2, "block-1": block_size - 1, "block": block_size, "block+1": block_size + 1,
        "window+1": LARGEST_WINDOW + 1, "3blocks+3": 3 * block_size + 3, "long": 150,
    }


@pytest.mark.parametrize("case", ["one", "two", "block-1", "block", "block+1", "window+1", "3blocks+3", "long"])
def test_prefill_then_decode_equals_colocated(pair, case):
    prefill, decode, block_size = pair
    length = _lengths(block_size)[case]
    body = greedy_body(_prompt(length, seed=1000 + length))
    expected = colocated_token_ids(prefill, body)
    bytes_before = metric_total(decode, "hybridpd:kv_bytes_read_total")

    params = prefill_call(prefill, body)
    assert params["first_token_id"] == expected[0]
    status, answer = decode_call(decode, body, params)

    assert status == 200, answer
    assert answer["choices"][0]["token_ids"] == expected
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the decoder never saw this prompt
    assert metric_total(decode, "hybridpd:kv_bytes_read_total") > bytes_before   # even a one-token prompt's state
    assert_drained(prefill, decode)


def colocated_and_pd_choices(prefill, decode, body: dict) -> tuple[dict, dict]:
    """The choice the prefill node answers for `body` alone (colocated), then the one P/D answers."""
    status, colocated = prefill.post_json("/v1/completions", body)
    assert status == 200, colocated
    status, answer = decode_call(decode, body, prefill_call(prefill, body))
    assert status == 200, answer
    return colocated["choices"][0], answer["choices"][0]


@pytest.mark.parametrize("length", [1, 21, 150])
def test_seeded_sampling_and_logprobs_through_pd_equal_colocated(pair, length):
    """The prefill node samples the first token from the seed and sends its logprobs; the decode node's generator
    skips that draw, so every later token is the colocated one too."""
    prefill, decode, _ = pair
    body = {"prompt": _prompt(length, seed=5000 + length), "max_tokens": 8, "temperature": 0.9, "top_k": 50,
            "seed": 11, "logprobs": 3, "ignore_eos": True, "return_token_ids": True}
    want, got = colocated_and_pd_choices(prefill, decode, body)
    assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]
    assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-4)
    assert [sorted(top) for top in got["logprobs"]["top_logprobs"]] == [
        sorted(top) for top in want["logprobs"]["top_logprobs"]]
    assert_drained(prefill, decode)


TINY_EOS = 316


@pytest.mark.parametrize("length", [1, 21, 150])
def test_logits_processors_through_pd_equal_colocated(pair, length):
    """Penalties, min_p, logit_bias and min_tokens (the prefill node takes it cut to its one token, as vLLM's toy
    proxy sends max_tokens 1): the prefill node draws the first token under them, the decode node goes on with
    that token in the output they count."""
    prefill, decode, _ = pair
    body = {"prompt": _prompt(length, seed=7000 + length), "max_tokens": 10, "temperature": 0.8, "seed": 7,
            "min_p": 0.02, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3,
            "min_tokens": 3, "logit_bias": {str(TINY_EOS): 6.0}, "return_token_ids": True}
    want, got = colocated_and_pd_choices(prefill, decode, body)
    assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]
    assert got["finish_reason"] == want["finish_reason"] and len(got["token_ids"]) > 3
    assert TINY_EOS not in got["token_ids"][:3]
    assert_drained(prefill, decode)


def test_a_stop_token_id_ends_a_pd_request_where_it_ends_a_colocated_one(pair):
    prefill, decode, _ = pair
    body = greedy_body(_prompt(30, seed=8000), max_tokens=12)
    plain = colocated_token_ids(prefill, body)
    k = next(k for k in range(2, len(plain)) if plain[k] not in plain[:k])
    body |= {"stop_token_ids": [plain[k]]}

    status, answer = decode_call(decode, body, prefill_call(prefill, body))

    assert status == 200, answer
    choice = answer["choices"][0]
    assert choice["token_ids"] == plain[:k + 1]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == plain[k]
    assert_drained(prefill, decode)


def test_a_request_its_first_token_ends_pulls_nothing_and_frees_the_lease(pair):
    prefill, decode, _ = pair
    body = greedy_body(_prompt(40, seed=6000), max_tokens=1)
    expected = colocated_token_ids(prefill, body)
    bytes_before = metric_total(decode, "hybridpd:kv_bytes_read_total")
    expired_before = metric_total(prefill, "hybridpd:kv_leases_expired_total")

    status, answer = decode_call(decode, body, prefill_call(prefill, body))

    assert status == 200, answer
    assert answer["choices"][0]["token_ids"] == expected and answer["choices"][0]["finish_reason"] == "length"
    assert metric_total(decode, "hybridpd:kv_bytes_read_total") == bytes_before
    wait_for_metric_at_most(prefill, "hybridpd:kv_leases_held", 0)
    assert metric_total(prefill, "hybridpd:kv_leases_expired_total") == expired_before   # released, not expired
    assert_drained(prefill, decode)


def test_eight_requests_in_flight(pair):
    """All 8 prefill calls answer first (a barrier), then the 8 decode calls pull and decode together."""
    prefill, decode, block_size = pair
    lengths = [2, block_size - 1, block_size + 1, 12, 33, 70, 101, 150]
    bodies = [greedy_body(_prompt(n, seed=2000 + i), max_tokens=6 + i) for i, n in enumerate(lengths)]
    expected = [colocated_token_ids(prefill, body) for body in bodies]
    barrier = threading.Barrier(IN_FLIGHT, timeout=BARRIER_TIMEOUT_S)

    def run(body: dict) -> tuple[int, dict]:
        params = prefill_call(prefill, body)
        barrier.wait()
        return decode_call(decode, body, params)

    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        answers = list(pool.map(run, bodies))

    for (status, answer), want in zip(answers, expected):
        assert status == 200, answer
        assert answer["choices"][0]["token_ids"] == want
    assert_drained(prefill, decode)


@pytest.mark.parametrize("length", [1, 40])
def test_streamed_decode_call_equals_colocated(pair, length):
    prefill, decode, _ = pair
    body = greedy_body(_prompt(length, seed=3000 + length), max_tokens=10)
    expected = colocated_token_ids(prefill, body)

    streamed = decode_call_streamed(decode, body, prefill_call(prefill, body))

    assert list(streamed.token_ids) == expected
    assert streamed.finish_reason == "length"
    assert streamed.usage["completion_tokens"] == 10 and streamed.usage["prompt_tokens"] == length
    assert_drained(prefill, decode)


def test_roles_swap_request_by_request(pair):
    """Every node is kv_both: the decode node prefills for the prefill node, and outputs still agree."""
    prefill, decode, _ = pair
    body = greedy_body(_prompt(60, seed=4000))
    expected = colocated_token_ids(decode, body)
    token_ids, usage = pd_token_ids(decode, prefill, body)
    assert token_ids == expected and usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert_drained(prefill, decode)


def test_one_node_in_both_roles_pulls_from_itself(pair):
    """A proxy that lists a node as both prefiller and decoder may send both calls of a request to it: the node pulls
    what its own prefill holds (NIXL's loopback), and outputs still agree."""
    prefill, decode, _ = pair
    body = greedy_body(_prompt(61, seed=4100))
    expected = colocated_token_ids(prefill, body)
    bytes_before = metric_total(decode, "hybridpd:kv_bytes_read_total")
    token_ids, _ = pd_token_ids(decode, decode, body)
    assert token_ids == expected
    assert metric_total(decode, "hybridpd:kv_bytes_read_total") > bytes_before   # the partial block and the states
    assert_drained(prefill, decode)


@pytest.mark.parametrize("body", [
    {"max_tokens": 4, "prompt_logprobs": 2, "temperature": 0, "ignore_eos": True},
    {"max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0},   # lm-evaluation-harness's loglikelihood
])
def test_a_request_scoring_its_prompt_split_as_the_toy_proxy_splits_it(pair, body):
    """vLLM's toy proxy splits every request: the decode node, which a pull would give KV but no logprobs, computes
    the prompt itself and lets the prefill node's blocks go at once; the answer is the colocated one."""
    prefill, decode, _ = pair
    body = {"prompt": _prompt(40, seed=77), "return_token_ids": True, **body}
    want, got = colocated_and_pd_choices(prefill, decode, body)
    assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]
    assert [sorted(step) if step else step for step in got["prompt_logprobs"]] == [
        sorted(step) if step else step for step in want["prompt_logprobs"]]
    for mine, theirs in zip(got["prompt_logprobs"][1:], want["prompt_logprobs"][1:]):
        for token, entry in theirs.items():
            assert mine[token]["rank"] == entry["rank"]
            assert mine[token]["logprob"] == pytest.approx(entry["logprob"], abs=1e-4)
    expired = metric_total(prefill, "hybridpd:kv_leases_expired_total")
    wait_for_metric_at_most(prefill, "hybridpd:kv_leases_held", 0)   # released by the decode node (a lease lasts 60 s)
    assert metric_total(prefill, "hybridpd:kv_leases_expired_total") == expired
    assert_drained(prefill, decode)
