"""`--no-decode-skip-mamba-align`: a remotely prefilled prompt whose local hit on the decode node covers every
group, Mamba included, up to N-1 tokens (a hit stops short of the prompt's end) still pulls the rest: the last
prompt token's blocks and the Mamba state after the whole prompt, since the decode node computes no prompt token
and goes on from the prefill node's first token. Prompts whose N-1 falls on the Mamba interval (hit N-1) and off it
(a smaller hit) must both give the colocated tokens.

The decode node first serves the prompt itself (so it caches every Mamba state on the interval), then the same
prompt arrives through P/D.
"""

from __future__ import annotations

import random

import pytest
import torch

from hybridpd.presets.checkpoints import write_checkpoint
from tests.e2e.pd_calls import (
    assert_drained, colocated_token_ids, decode_call, greedy_body, prefill_call, start_nodes, stop_all,
)

INTERVAL = 8  # tiny: lcm(block size 4, Mamba chunk 8)
NODE_ARGS = ("--kv-cache-memory", "64MiB", "--max-model-len", "256", "--kv-load-timeout", "10", "--block-size", "4")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.set_num_threads(1)
    model_dir = write_checkpoint("tiny", tmp_path_factory.mktemp("tiny"))
    nodes = start_nodes(model_dir, tmp_path_factory.mktemp("logs"),
                        {"prefill": NODE_ARGS, "decode": (*NODE_ARGS, "--no-decode-skip-mamba-align")})
    try:
        yield nodes["prefill"], nodes["decode"]
    finally:
        stop_all(nodes.values())


@pytest.mark.parametrize("length, hit", [
    (4 * INTERVAL + 1, 4 * INTERVAL),       # N-1 on the interval: the local hit is all but the last token
    (4 * INTERVAL + 5, 4 * INTERVAL),       # N-1 off the interval: the hit stops at the last boundary
    (2 * INTERVAL + 1, 2 * INTERVAL),
])
def test_a_local_hit_of_the_whole_prompt_still_gives_the_colocated_tokens(pair, length, hit):
    prefill, decode = pair
    rng = random.Random(length)
    body = greedy_body([rng.randrange(256) for _ in range(length)], max_tokens=8)
    expected = colocated_token_ids(prefill, body)          # the reference, from the other node
    assert colocated_token_ids(decode, body) == expected   # the decode node now caches the prompt's states
    status, answer = decode_call(decode, body, prefill_call(prefill, body))
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == hit
    assert answer["choices"][0]["token_ids"] == expected
    assert_drained(prefill, decode)
