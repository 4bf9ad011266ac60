"""Checkpoints written by transformers' own `save_pretrained`, served by our engine, against transformers.

What a user arrives with: a directory transformers wrote (its config.json encodings — `{"__float__": "Infinity"}`,
`rope_parameters`, `dtype`, a list-valued `eos_token_id` —, `generation_config.json`, one or sharded safetensors, bf16
weights). Each scenario builds a small random `GraniteMoeHybridConfig` model in transformers, gives it weights of a
useful scale, saves it, and compares every logits row our engine samples from with transformers' full forward
(`from_pretrained` of the same directory, float32), and the greedy tokens: dense, MoE (router top-k, experts, shared
MLP), and a sharded bf16 save loaded in float32; each run alone and then with a prefix hit.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from hybridpd.engine.model.config_fields import read_config_json
from tests.oracle.saved_models import GRANITE_VARIANTS, check_alone_then_with_a_prefix_hit, save_granite
from tests.oracle.test_engine_vs_transformers import (
    Recorder, make_engine, prompt,
)


@pytest.fixture(scope="module", params=sorted(GRANITE_VARIANTS))
def saved(request, tmp_path_factory):
    torch.set_num_threads(1)
    variant = request.param
    return (variant, *save_granite(tmp_path_factory.mktemp(variant), variant))


def test_transformers_wrote_what_users_have(saved):
    """The directory holds transformers' own encodings: the reason this suite exists."""
    variant, out, _ = saved
    raw = json.loads((out / "config.json").read_text())
    assert raw["time_step_limit"][1] == {"__float__": "Infinity"}
    assert read_config_json(out / "config.json")["time_step_limit"][1] == math.inf
    assert raw["eos_token_id"] == [298, 299] and "rope_parameters" in raw and "dtype" in raw
    assert (out / "generation_config.json").is_file()
    sharded = (out / "model.safetensors.index.json").is_file()
    assert sharded == variant.endswith("bf16")
    if sharded:
        assert raw["dtype"] == "bfloat16" and len(list(out.glob("model-*.safetensors"))) > 1


def test_engine_matches_transformers_alone_and_with_a_prefix_hit(saved):
    _, model_dir, reference = saved
    check_alone_then_with_a_prefix_hit(model_dir, reference, greedy_of="a")


def test_every_listed_eos_stops(saved):
    """eos_token_id: [298, 299] — the second id stops a request as the first does."""
    _, model_dir, _ = saved
    engine = make_engine(model_dir, Recorder())
    from hybridpd.engine.request import EngineRequest
    from hybridpd.engine.sampling_params import SamplingParams

    # Force the model's choice: a logits hook that makes token 299 the argmax at the first sampled step.
    def force(plan, logits):
        logits[:, 299] = logits.max() + 10.0

    engine.runner.logits_hook = force
    engine.add_request(EngineRequest(request_id="x", prompt_token_ids=prompt(4, 9),
                                     sampling=SamplingParams(max_tokens=5, temperature=0.0)))
    outputs = []
    while engine.has_work():
        outputs.extend(engine.step())
    assert outputs[-1].finished and outputs[-1].finish_reason.value == "stop"
    assert [t for o in outputs for t in o.new_token_ids] == [299]
