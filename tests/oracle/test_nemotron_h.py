"""Nemotron-H checkpoints written by transformers' `save_pretrained`, served by our engine, against transformers.

Two tiny random models with every layer kind (Mamba2, attention, MLP, MoE with expert groups and a score
correction bias): one as transformers builds it, one with our two extension keys (a layer with other KV heads, two
sliding windows), for which the reference's attention modules are patched the way `tests/oracle/reference.py`
patches Granite's. Every logits row the engine samples from must be within 1e-4 of transformers' full forward, and
greedy tokens identical; then a second request hits the prefix cache in every group.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

from tests.oracle.reference import _patch_kv_heads, _patch_window
from tests.oracle.test_engine_vs_transformers import (
    Recorder, assert_drained, check_against_reference, make_engine, prompt, run,
)

SHAPE = dict(
    vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16, n_groups=2, chunk_size=8,
    n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=48, moe_shared_expert_intermediate_size=40,
    n_group=3, topk_group=2, routed_scaling_factor=1.5, max_position_embeddings=512, eos_token_id=[298, 299],
    bos_token_id=297, pad_token_id=0, time_step_min=0.001,
)
VARIANTS = {
    "moe": dict(hybrid_override_pattern="M*-EM*E"),
    "extensions": dict(layers_block_type=["mamba", "attention", "moe", "attention", "mlp", "attention"],
                       kv_heads_per_layer=[None, 1, None, None, None, 4],
                       sliding_window_per_layer=[None, None, None, 7, None, 13]),
}


def _useful_scale(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("A_log", "D", "dt_bias") or "norm" in name:
                continue
            std = 0.5 if "embeddings" in name else 1.0 / math.sqrt(param.shape[-1])
            param.copy_(torch.randn(param.shape, generator=generator) * std)
        for layer in model.model.layers:
            if layer.block_type == "moe":  # a non-zero correction bias: selection and weights differ
                layer.mixer.gate.e_score_correction_bias.copy_(torch.randn(6, generator=generator) * 0.3)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def saved(request, tmp_path_factory):
    torch.set_num_threads(1)
    variant = request.param
    config = NemotronHConfig(**(SHAPE | VARIANTS[variant]))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = NemotronHForCausalLM(config).eval()
    windows = VARIANTS[variant].get("sliding_window_per_layer", [None] * len(model.model.layers))
    kv_heads = VARIANTS[variant].get("kv_heads_per_layer", [None] * len(model.model.layers))
    for layer, kv, window in zip(model.model.layers, kv_heads, windows):
        if kv is not None:
            _patch_kv_heads(layer.mixer, kv, config)
        if window is not None:
            _patch_window(layer.mixer, window)
    _useful_scale(model, seed=len(variant))
    out = tmp_path_factory.mktemp(variant)
    model.save_pretrained(out)
    if variant == "moe":  # the reference reads the directory back, as a user's transformers would
        model = NemotronHForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    return out, model


def test_engine_matches_transformers_alone_and_with_a_prefix_hit(saved):
    model_dir, reference = saved
    recorder = Recorder()
    engine = make_engine(model_dir, recorder)
    assert engine.eos_token_ids >= {298, 299}
    requests = {"a": prompt(1, 37), "b": prompt(2, 23)}
    outputs = run(engine, requests, max_tokens=8)
    check_against_reference(reference, requests, outputs, recorder)
    greedy = reference.generate(torch.tensor([requests["b"]]), max_new_tokens=8, do_sample=False,
                                min_new_tokens=8, pad_token_id=0)
    assert outputs["b"] == greedy[0, len(requests["b"]):].tolist()

    recorder.rows.clear()
    second = {"c": requests["a"][:32] + prompt(3, 6)}
    outputs = run(engine, second, max_tokens=6)
    assert all(s.hit_tokens > 0 for s in engine.kv.stats()), engine.kv.stats()
    check_against_reference(reference, second, outputs, recorder)
    assert_drained(engine)
