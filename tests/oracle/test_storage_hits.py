"""A prefix hit that only the storage tier holds, against transformers: one engine computes and writes behind, and
a second one (a restarted node, or another node sharing the directory: fresh memory, the same files) reads the
prefix back. Every logits row it samples must be within the oracle tolerance of transformers' full forward, greedy
tokens identical, on checkpoints transformers wrote: Granite-4.0-H (Mamba2 and full attention) and Nemotron-H with
two sliding windows and another KV-head count, so every group kind is read from storage."""

from __future__ import annotations

import pytest
import torch

from tests.oracle.saved_models import save_granite, save_nemotron
from tests.oracle.test_engine_vs_transformers import (
    Recorder, assert_drained, check_against_reference, make_engine, prompt, run,
)

SAVERS = {"granite_dense": lambda out: save_granite(out, "dense"),
          "nemotron_h_extensions": lambda out: save_nemotron(out, "extensions")}


@pytest.fixture(scope="module", params=sorted(SAVERS))
def saved(request, tmp_path_factory):
    torch.set_num_threads(1)
    return SAVERS[request.param](tmp_path_factory.mktemp(request.param))


def test_a_prefix_read_from_storage_matches_transformers(saved, tmp_path):
    model_dir, reference = saved
    writer = make_engine(model_dir, Recorder(), offload_dir=tmp_path)
    run(writer, {"a": prompt(1, 45)}, max_tokens=4)
    writer.close()
    assert writer.offload.counters.written > 0

    recorder = Recorder()
    reader = make_engine(model_dir, recorder, offload_dir=tmp_path)   # nothing in memory
    requests = {"b": prompt(1, 45)[:40] + prompt(2, 9)}
    outputs = run(reader, requests, max_tokens=6)
    assert reader.offload.counters.loaded_blocks > 0 and reader.offload.counters.load_misses == 0
    check_against_reference(reference, requests, outputs, recorder)
    assert_drained(reader)
    reader.close()
