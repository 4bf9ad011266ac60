"""Nemotron-H checkpoints written by transformers' `save_pretrained`, served by our engine, against transformers.

Two tiny random models with every layer kind (Mamba2, attention, MLP, MoE with expert groups and a score
correction bias): one as transformers builds it, one with our two extension keys (a layer with other KV heads, two
sliding windows), for which the reference's attention modules are patched the way `tests/oracle/reference.py`
patches Granite's. Every logits row the engine samples from must be within 1e-4 of transformers' full forward, and
greedy tokens identical; then a second request hits the prefix cache in every group.
"""

from __future__ import annotations

import pytest
import torch

from tests.oracle.saved_models import NEMOTRON_VARIANTS, greedy_reference, save_nemotron
from tests.oracle.test_engine_vs_transformers import (
    Recorder, assert_drained, check_against_reference, make_engine, prompt, run,
)


@pytest.fixture(scope="module", params=sorted(NEMOTRON_VARIANTS))
def saved(request, tmp_path_factory):
    torch.set_num_threads(1)
    return save_nemotron(tmp_path_factory.mktemp(request.param), request.param)


def test_engine_matches_transformers_alone_and_with_a_prefix_hit(saved):
    model_dir, reference = saved
    recorder = Recorder()
    engine = make_engine(model_dir, recorder)
    assert engine.eos_token_ids >= {298, 299}
    requests = {"a": prompt(1, 37), "b": prompt(2, 23)}
    outputs = run(engine, requests, max_tokens=8)
    check_against_reference(reference, requests, outputs, recorder)
    assert outputs["b"] == greedy_reference(reference, list(requests["b"]), 8)

    recorder.rows.clear()
    second = {"c": requests["a"][:32] + prompt(3, 6)}
    outputs = run(engine, second, max_tokens=6)
    assert all(s.hit_tokens > 0 for s in engine.kv.stats()), engine.kv.stats()
    check_against_reference(reference, second, outputs, recorder)
    assert_drained(engine)
