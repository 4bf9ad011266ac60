"""Decode-side prefix hits with two real nodes: a second request sharing a >= 1,024-token prefix with the first is
served from the decode node's own full-attention blocks (it skips Mamba alignment, since the Mamba state comes
from the prefill node anyway) and pulls only the rest; with `--no-decode-skip-mamba-align` its hit is 0.

Numbers (tiny preset, block size 16): full attention costs 384 bytes a token, the two Mamba layers' state 21 KB,
the windows (5 and 11) a block or two. The first request (1,230 tokens) reads ~490 KB; the second (1,036 tokens,
1,030 shared) hits 1,024 tokens and reads one full-attention block, the in-window blocks and the Mamba state,
~33 KB. The `small` preset does not fit the 10% bound at this length: its Mamba state alone (183 KB) is ~11% of
a 1,100-token first request.
"""

from __future__ import annotations

import random
import re

import pytest
import torch

from hybridpd.presets.checkpoints import write_checkpoint
from tests.e2e.pd_calls import (
    assert_drained,
    colocated_token_ids,
    greedy_body,
    metric_total,
    pd_token_ids,
    start_nodes,
    stop_all,
)

BLOCK_SIZE = 16
SHARED = 1030
ALIGNED_SHARED = SHARED // BLOCK_SIZE * BLOCK_SIZE
FIRST_TAIL, SECOND_TAIL = 200, 6
MAX_READ_FRACTION = 0.10
NODE_ARGS = ("--kv-cache-memory", "64MiB", "--max-model-len", "2048", "--block-size", str(BLOCK_SIZE),
             "--kv-load-timeout", "10")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    torch.set_num_threads(1)
    model_dir = write_checkpoint("tiny", tmp_path_factory.mktemp("tiny"))
    started = start_nodes(model_dir, tmp_path_factory.mktemp("logs"), {
        "prefill": NODE_ARGS,
        "decode": NODE_ARGS,
        "decode-no-skip": (*NODE_ARGS, "--no-decode-skip-mamba-align"),
    })
    try:
        yield started
    finally:
        stop_all(started.values())


@pytest.fixture(scope="module")
def prompts() -> tuple[list[int], list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(256) for _ in range(SHARED)]
    first_tail = [rng.randrange(256) for _ in range(FIRST_TAIL)]
    second_tail = [(first_tail[0] + 1) % 256, *(rng.randrange(256) for _ in range(SECOND_TAIL - 1))]
    return shared + first_tail, shared + second_tail


@pytest.fixture(scope="module")
def expected(nodes, prompts) -> tuple[list[int], list[int]]:
    """Colocated outputs, from the prefill node (same checkpoint and flags as the decoders)."""
    return tuple(colocated_token_ids(nodes["prefill"], greedy_body(p)) for p in prompts)


def cached_by_source(node) -> dict[str, float]:
    """vLLM's `vllm:prompt_tokens_cached_by_source` on `node`, by source."""
    values = node.metric_values("vllm:prompt_tokens_cached_by_source_total")
    return {re.search(r'source="([a-z0-9_]+)"', labels).group(1): value for labels, value in values.items()}


def _pd(nodes, decoder: str, prompt: list[int]) -> tuple[list[int], int, float, float]:
    """One P/D request; (token ids, cached_tokens, bytes read, decode-side hit tokens counted). The decode node's
    vLLM prompt-source counters grow by its hit (device) and what it pulled (p2p): the whole prompt between them, none
    of it computed there."""
    decode = nodes[decoder]
    bytes_before = metric_total(decode, "hybridpd:kv_bytes_read_total")
    hits_before = metric_total(decode, "hybridpd:kv_decode_hit_tokens_total")
    sources_before = cached_by_source(decode)
    computed_before = [metric_total(decode, f"vllm:request_prefill_kv_computed_tokens_{figure}")
                       for figure in ("sum", "count")]
    token_ids, usage = pd_token_ids(nodes["prefill"], decode, greedy_body(prompt))
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    computed = [metric_total(decode, f"vllm:request_prefill_kv_computed_tokens_{figure}") - before
                for figure, before in zip(("sum", "count"), computed_before)]
    assert computed == [0, 1], computed   # observed once, and nothing of the prompt computed here
    sources = {k: v - sources_before.get(k, 0.0) for k, v in cached_by_source(decode).items()}
    assert sources == {"device": cached, "host": 0, "p2p": len(prompt) - cached, "disk": 0,
                       "external_unspecified": 0}, sources
    return (token_ids, cached,
            metric_total(decode, "hybridpd:kv_bytes_read_total") - bytes_before,
            metric_total(decode, "hybridpd:kv_decode_hit_tokens_total") - hits_before)


@pytest.mark.parametrize("decoder, skips_mamba_align", [("decode", True), ("decode-no-skip", False)])
def test_second_request_hits_the_shared_prefix_on_the_decoder(nodes, prompts, expected, decoder, skips_mamba_align):
    first, second = prompts
    first_ids, first_cached, first_bytes, _ = _pd(nodes, decoder, first)
    assert first_ids == expected[0]
    assert first_cached == 0 and first_bytes > 0

    second_ids, second_cached, second_bytes, second_hits = _pd(nodes, decoder, second)

    assert second_ids == expected[1]
    assert second_hits == second_cached
    if skips_mamba_align:
        assert ALIGNED_SHARED <= second_cached <= SHARED, second_cached
        assert second_bytes <= MAX_READ_FRACTION * first_bytes, (second_bytes, first_bytes)
    else:  # the decoder holds no Mamba state at any boundary of the shared prefix: the Mamba group limits to 0
        assert second_cached == 0
        assert second_bytes > 0.5 * first_bytes, (second_bytes, first_bytes)
    assert_drained(nodes["prefill"], nodes[decoder])
