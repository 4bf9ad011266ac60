"""Small random models built in transformers and written by its own `save_pretrained` (what users arrive with).

Weights get a useful scale (transformers' std-0.02 init gives near-uniform logits, where greedy comparisons say
little). Each builder returns the directory and the transformers reference model for it (float32, eager).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import (
    FalconH1Config, FalconH1ForCausalLM, GenerationConfig, GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, NemotronHConfig,
    NemotronHForCausalLM,
)

from tests.oracle.reference import _patch_kv_heads, _patch_window

GRANITE_SHAPE = dict(
    vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    shared_intermediate_size=96, intermediate_size=48, layer_types=["mamba", "attention", "mamba", "attention"],
    mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=8, mamba_n_groups=2,
    position_embedding_type="rope", max_position_embeddings=512, embedding_multiplier=2.0,
    attention_multiplier=0.25, residual_multiplier=0.5, logits_scaling=1.5, eos_token_id=[298, 299],
    bos_token_id=297, pad_token_id=0, tie_word_embeddings=False,
)
GRANITE_VARIANTS = {
    "dense": dict(num_local_experts=0),
    "moe": dict(num_local_experts=6, num_experts_per_tok=2),
    "moe_sharded_bf16": dict(num_local_experts=4, num_experts_per_tok=3, tie_word_embeddings=True),
}
NEMOTRON_SHAPE = dict(
    vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16, n_groups=2, chunk_size=8,
    n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=48, moe_shared_expert_intermediate_size=40,
    n_group=3, topk_group=2, routed_scaling_factor=1.5, max_position_embeddings=512, eos_token_id=[298, 299],
    bos_token_id=297, pad_token_id=0, time_step_min=0.001,
)
NEMOTRON_VARIANTS = {
    "moe": dict(hybrid_override_pattern="M*-EM*E"),
    "extensions": dict(layers_block_type=["mamba", "attention", "moe", "attention", "mlp", "attention"],
                       kv_heads_per_layer=[None, 1, None, None, None, 4],
                       sliding_window_per_layer=[None, None, None, 7, None, 13]),
}

FALCON_H1_SHAPE = dict(
    vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, mamba_d_ssm=128, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=2,
    mamba_chunk_size=8, max_position_embeddings=512, eos_token_id=[298, 299], bos_token_id=297, pad_token_id=0,
    # μP multipliers away from 1, each where a mistake would show
    embedding_multiplier=2.0, lm_head_multiplier=0.75, key_multiplier=0.8, attention_in_multiplier=1.2,
    attention_out_multiplier=0.7, ssm_in_multiplier=1.1, ssm_out_multiplier=0.6,
    ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 1.3], mlp_multipliers=[1.5, 0.5],
)
FALCON_H1_VARIANTS = {
    "norm_after_gate": dict(mamba_rms_norm=True, mamba_norm_before_gate=False),
    "norm_before_gate": dict(mamba_rms_norm=True, mamba_norm_before_gate=True, rope_theta=1e11),
    "no_norm_tied": dict(mamba_rms_norm=False, tie_word_embeddings=True, mamba_proj_bias=True, projectors_bias=True),
}


def _useful_scale(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("A_log", "D", "dt_bias") or "norm" in name:
                continue
            std = 0.5 if "embed" in name else 1.0 / math.sqrt(param.shape[-1])
            param.copy_(torch.randn(param.shape, generator=generator) * std)
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):  # non-zero: selection and weights differ
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.3)


def save_granite(out: Path, variant: str) -> tuple[Path, GraniteMoeHybridForCausalLM]:
    config = GraniteMoeHybridConfig(**(GRANITE_SHAPE | GRANITE_VARIANTS[variant]))
    torch.manual_seed(0)
    model = GraniteMoeHybridForCausalLM(config).eval()
    _useful_scale(model, seed=len(variant))
    if variant.endswith("bf16"):
        model.to(torch.bfloat16).save_pretrained(out, max_shard_size="150KB")
    else:
        model.save_pretrained(out)
    reference = GraniteMoeHybridForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    return out, reference.eval()


def save_nemotron(out: Path, variant: str) -> tuple[Path, NemotronHForCausalLM]:
    """With the extension keys the reference is the patched in-memory model (transformers cannot read them back)."""
    config = NemotronHConfig(**(NEMOTRON_SHAPE | NEMOTRON_VARIANTS[variant]))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = NemotronHForCausalLM(config).eval()
    layers = model.model.layers
    windows = NEMOTRON_VARIANTS[variant].get("sliding_window_per_layer", [None] * len(layers))
    kv_heads = NEMOTRON_VARIANTS[variant].get("kv_heads_per_layer", [None] * len(layers))
    for layer, kv, window in zip(layers, kv_heads, windows):
        if kv is not None:
            _patch_kv_heads(layer.mixer, kv, config)
        if window is not None:
            _patch_window(layer.mixer, window)
    _useful_scale(model, seed=len(variant))
    model.save_pretrained(out)
    if variant == "extensions":
        return out, model
    reference = NemotronHForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    return out, reference.eval()


def save_falcon_h1(out: Path, variant: str) -> tuple[Path, FalconH1ForCausalLM]:
    config = FalconH1Config(**(FALCON_H1_SHAPE | FALCON_H1_VARIANTS[variant]))
    torch.manual_seed(0)
    model = FalconH1ForCausalLM(config).eval()
    _useful_scale(model, seed=len(variant))
    model.save_pretrained(out)
    reference = FalconH1ForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    return out, reference.eval()


def greedy_reference(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy `generate` as a request with `ignore_eos` runs: an eos token may be chosen and generation
    goes on past it (`min_new_tokens` would instead forbid eos, another distribution)."""
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt):].tolist()


def check_alone_then_with_a_prefix_hit(model_dir: Path, reference: torch.nn.Module, greedy_of: str) -> None:
    """The engine on `model_dir` against `reference`: two requests at once (every sampled logits row within 1e-4,
    request `greedy_of`'s tokens equal to transformers' `generate`), then a request sharing 32 tokens of the first,
    which hits the prefix cache in every group and matches too; every block is back afterwards."""
    from tests.oracle.test_engine_vs_transformers import (
        Recorder, assert_drained, check_against_reference, make_engine, prompt, run,
    )

    recorder = Recorder()
    engine = make_engine(model_dir, recorder)
    assert engine.eos_token_ids >= {298, 299}
    requests = {"a": prompt(1, 37), "b": prompt(2, 23)}
    outputs = run(engine, requests, max_tokens=8)
    check_against_reference(reference, requests, outputs, recorder)
    assert outputs[greedy_of] == greedy_reference(reference, list(requests[greedy_of]), 8)

    recorder.rows.clear()
    second = {"c": requests["a"][:32] + prompt(3, 6)}
    outputs = run(engine, second, max_tokens=6)
    assert all(s.hit_tokens > 0 for s in engine.kv.stats()), engine.kv.stats()
    check_against_reference(reference, second, outputs, recorder)
    assert_drained(engine)
