"""P/D on checkpoints transformers wrote: a sharded bf16 MoE Granite-4.0-H, a Nemotron-H with MoE layers, and a
Falcon-H1 (attention and Mamba2 in every layer).

Two real nodes (prefill, decode), driven as vLLM's toy proxy does. The greedy tokens through P/D must equal
transformers' own `generate` on the same directory; a second prompt sharing a prefix hits the decode node's own
full-attention blocks (so it pulls only the rest) and still equals the reference. Blocks all return afterwards.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.e2e.pd_calls import assert_drained, greedy_body, pd_token_ids, start_nodes, stop_all
from tests.oracle.saved_models import greedy_reference, save_falcon_h1, save_granite, save_nemotron

NODE_ARGS = ("--kv-cache-memory", "64MiB", "--max-model-len", "256", "--kv-load-timeout", "10", "--block-size", "8")
SAVERS = {"granite_moe_sharded_bf16": lambda out: save_granite(out, "moe_sharded_bf16"),
          "nemotron_h_moe": lambda out: save_nemotron(out, "moe"),
          "falcon_h1": lambda out: save_falcon_h1(out, "norm_after_gate")}


@pytest.fixture(scope="module", params=sorted(SAVERS))
def cluster(request, tmp_path_factory):
    torch.set_num_threads(1)
    model_dir, reference = SAVERS[request.param](tmp_path_factory.mktemp(request.param))
    nodes = start_nodes(model_dir, tmp_path_factory.mktemp("logs"), {"prefill": NODE_ARGS, "decode": NODE_ARGS})
    try:
        yield nodes["prefill"], nodes["decode"], reference
    finally:
        stop_all(nodes.values())


def test_pd_equals_transformers_then_hits_the_decode_side_prefix(cluster):
    prefill, decode, reference = cluster
    rng = random.Random(7)
    first = [rng.randrange(290) for _ in range(45)]
    ids, usage = pd_token_ids(prefill, decode, greedy_body(first, max_tokens=6))
    assert ids == greedy_reference(reference, first, 6)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0

    second = first[:40] + [rng.randrange(290) for _ in range(7)]
    ids, usage = pd_token_ids(prefill, decode, greedy_body(second, max_tokens=6))
    assert ids == greedy_reference(reference, second, 6)
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 32  # the decode node's own full-attention blocks
    assert_drained(prefill, decode)
