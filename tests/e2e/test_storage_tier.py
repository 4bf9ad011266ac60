"""The storage tier across a restart, with real `hybridpd serve` processes: a node writes behind the blocks of a
prompt, stops, and a new node on the same directory (a restarted node, or another one sharing the volume) serves a
prompt sharing its prefix from storage alone (its memory is empty): cached tokens reported, and the same greedy
tokens as a node without the tier computing everything."""

from __future__ import annotations

import random

import pytest
import torch

from hybridpd.presets.checkpoints import write_checkpoint
from tests.e2e.pd_calls import (
    assert_drained, colocated_token_ids, greedy_body, metric_total, pd_token_ids, start_nodes, stop_all,
)

ARGS = ("--kv-cache-memory", "64MiB", "--block-size", "16", "--max-model-len", "1024")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return write_checkpoint("tiny", tmp_path_factory.mktemp("tiny"))


def test_a_restarted_node_serves_the_prefix_from_storage(model_dir, tmp_path):
    rng = random.Random(11)
    first = [rng.randrange(250) for _ in range(300)]
    second = first[:260] + [rng.randrange(250) for _ in range(20)]
    tier = ("--kv-offload-dir", str(tmp_path / "kv"), "--kv-offload-size", "256MiB")
    for logs in ("logs", "logs2"):
        (tmp_path / logs).mkdir()

    nodes = start_nodes(model_dir, tmp_path / "logs", {"writer": ARGS + tier, "plain": ARGS})
    try:
        colocated_token_ids(nodes["writer"], greedy_body(first, max_tokens=4))
        expected = colocated_token_ids(nodes["plain"], greedy_body(second, max_tokens=8))
    finally:
        stop_all(nodes.values())   # a graceful stop flushes the write-behind queue
    assert list((tmp_path / "kv").rglob("*.kv"))

    nodes = start_nodes(model_dir, tmp_path / "logs2", {"restarted": ARGS + tier})
    try:
        status, answer = nodes["restarted"].post_json("/v1/completions", greedy_body(second, max_tokens=8))
        assert status == 200, answer
        assert answer["choices"][0]["token_ids"] == expected
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256   # read from storage
        assert metric_total(nodes["restarted"], "hybridpd:kv_offload_hit_tokens_total") >= 256
        assert metric_total(nodes["restarted"], "hybridpd:kv_offload_load_misses_total") == 0
        assert metric_total(nodes["restarted"], "hybridpd:kv_offload_thread_cpu_seconds_total") > 0   # the loader's
        assert_drained(nodes["restarted"])
    finally:
        stop_all(nodes.values())


def test_a_restarted_decode_node_reads_its_full_attention_prefix_from_storage(model_dir, tmp_path):
    """P/D: the decode node (Mamba alignment skipped) takes the full-attention blocks the shared directory holds
    beyond its empty memory, and pulls only the rest from the prefill node."""
    rng = random.Random(5)
    first = [rng.randrange(250) for _ in range(300)]
    second = first[:260] + [rng.randrange(250) for _ in range(20)]
    tier = ("--kv-offload-dir", str(tmp_path / "kv"), "--kv-offload-size", "256MiB")
    for logs in ("logs", "logs2"):
        (tmp_path / logs).mkdir()
    pd_args = ARGS + ("--kv-load-timeout", "10")

    nodes = start_nodes(model_dir, tmp_path / "logs", {"prefill": pd_args, "decode": pd_args + tier, "plain": ARGS})
    try:
        pd_token_ids(nodes["prefill"], nodes["decode"], greedy_body(first, max_tokens=4))
        expected = colocated_token_ids(nodes["plain"], greedy_body(second, max_tokens=8))
        stop_all([nodes["decode"], nodes["plain"]])   # the decode node restarts; its writes are flushed
        decode = start_nodes(model_dir, tmp_path / "logs2", {"decode": pd_args + tier})["decode"]
        nodes["decode"] = decode
        ids, usage = pd_token_ids(nodes["prefill"], decode, greedy_body(second, max_tokens=8))
        assert ids == expected
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 256   # its full-attention prefix, from storage
        assert metric_total(decode, "hybridpd:kv_offload_hit_tokens_total") >= 256
        assert_drained(nodes["prefill"], decode)
    finally:
        stop_all(nodes.values())
