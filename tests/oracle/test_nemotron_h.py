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

from tests.oracle.saved_models import NEMOTRON_VARIANTS, check_alone_then_with_a_prefix_hit, save_nemotron


@pytest.fixture(scope="module", params=sorted(NEMOTRON_VARIANTS))
def saved(request, tmp_path_factory):
    torch.set_num_threads(1)
    return save_nemotron(tmp_path_factory.mktemp(request.param), request.param)


def test_engine_matches_transformers_alone_and_with_a_prefix_hit(saved):
    model_dir, reference = saved
    check_alone_then_with_a_prefix_hit(model_dir, reference, greedy_of="b")
