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
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

from hybridpd.engine.model.config import read_config_json
from tests.oracle.test_engine_vs_transformers import (
    Recorder, assert_drained, check_against_reference, make_engine, prompt, run,
)

SHAPE = dict(
    vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    shared_intermediate_size=96, intermediate_size=48, layer_types=["mamba", "attention", "mamba", "attention"],
    mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=8, mamba_n_groups=2,
    position_embedding_type="rope", max_position_embeddings=512, embedding_multiplier=2.0,
    attention_multiplier=0.25, residual_multiplier=0.5, logits_scaling=1.5, eos_token_id=[298, 299],
    bos_token_id=297, pad_token_id=0, tie_word_embeddings=False,
)
VARIANTS = {
    "dense": dict(num_local_experts=0),
    "moe": dict(num_local_experts=6, num_experts_per_tok=2),
    "moe_sharded_bf16": dict(num_local_experts=4, num_experts_per_tok=3, tie_word_embeddings=True),
}


def _useful_scale(model: torch.nn.Module, seed: int) -> None:
    """transformers' init (std 0.02) gives near-uniform logits; fan-in scaled weights spread them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("A_log", "D", "dt_bias") or "norm" in name:
                continue
            std = 0.5 if "embed_tokens" in name else 1.0 / math.sqrt(param.shape[-1])
            param.copy_(torch.randn(param.shape, generator=generator) * std)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def saved(request, tmp_path_factory):
    torch.set_num_threads(1)
    variant = request.param
    config = GraniteMoeHybridConfig(**(SHAPE | VARIANTS[variant]))
    torch.manual_seed(0)
    model = GraniteMoeHybridForCausalLM(config).eval()
    _useful_scale(model, seed=len(variant))
    out = tmp_path_factory.mktemp(variant)
    if variant.endswith("bf16"):
        model.to(torch.bfloat16).save_pretrained(out, max_shard_size="150KB")
    else:
        model.save_pretrained(out)
    reference = GraniteMoeHybridForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    return variant, out, reference


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
    recorder = Recorder()
    engine = make_engine(model_dir, recorder)
    assert engine.eos_token_ids >= {298, 299}
    requests = {"a": prompt(1, 37), "b": prompt(2, 21)}
    outputs = run(engine, requests, max_tokens=8)
    check_against_reference(reference, requests, outputs, recorder)
    greedy = reference.generate(torch.tensor([requests["a"]]), max_new_tokens=8, do_sample=False,
                                min_new_tokens=8, pad_token_id=0)
    assert outputs["a"] == greedy[0, len(requests["a"]):].tolist()

    recorder.rows.clear()
    second = {"c": requests["a"][:32] + prompt(3, 6)}
    outputs = run(engine, second, max_tokens=6)
    assert all(s.hit_tokens > 0 for s in engine.kv.stats()), engine.kv.stats()
    check_against_reference(reference, second, outputs, recorder)
    assert_drained(engine)


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
