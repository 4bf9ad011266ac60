"""Falcon-H1 checkpoints written by transformers' `save_pretrained`, served by our engine, against transformers.

Attention and Mamba2 side by side in every layer (so every layer owns both KV blocks and a state), with Falcon-H1's
μP multipliers away from 1; three variants of how Mamba's output meets its gate (a gated RMSNorm after the gate,
one before it, none). Every logits row the engine samples must be within 1e-4 of transformers' full forward and the
greedy tokens identical; then a second request hits the prefix cache in every group.
"""

from __future__ import annotations

import pytest
import torch

from tests.oracle.saved_models import FALCON_H1_VARIANTS, check_alone_then_with_a_prefix_hit, save_falcon_h1


@pytest.fixture(scope="module", params=sorted(FALCON_H1_VARIANTS))
def saved(request, tmp_path_factory):
    torch.set_num_threads(1)
    return save_falcon_h1(tmp_path_factory.mktemp(request.param), request.param)


def test_engine_matches_transformers_alone_and_with_a_prefix_hit(saved):
    model_dir, reference = saved
    check_alone_then_with_a_prefix_hit(model_dir, reference, greedy_of="b")
