"""The independent reference: transformers' `GraniteMoeHybridForCausalLM` on a checkpoint directory.

transformers knows neither extension key, so this module patches the reference model:
- `kv_heads_per_layer`: that layer's `k_proj`/`v_proj` are rebuilt with the layer's KV-head count (before the
  weights are loaded, so the checkpoint's tensors must fit them) and its `num_key_value_groups` is set;
- `sliding_window_per_layer`: that layer's attention gets a band mask (query i sees key j iff i - W < j <= i)
  instead of the causal one; the mask accounts for cached keys, so `generate` works too.
`reference_logits` runs one full forward over the whole token sequence (float32, eager); the throughput
benchmark loads the same model with transformers' default attention and runs `generate`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM


def _band_mask(past: int, length: int, window: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive [1, 1, length, past + length] mask for queries at positions past.. over keys 0..past+length-1:
    0 where i - window < j <= i, the dtype's minimum elsewhere."""
    i = torch.arange(past, past + length)[:, None]
    j = torch.arange(past + length)[None, :]
    visible = (j <= i) & (j > i - window)
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def _patch_window(attn: nn.Module, window: int) -> None:
    original = attn.forward

    def forward(hidden_states, attention_mask, past_key_values=None, **kwargs):
        # transformers >= 5.2x hands the cache over as `cache` (`past_key_values` is its deprecated name)
        cache = kwargs.get("cache") if kwargs.get("cache") is not None else past_key_values
        past = cache.get_seq_length(attn.layer_idx) if cache is not None else 0
        mask = _band_mask(past, hidden_states.shape[1], window, hidden_states.dtype)
        if past_key_values is not None:
            kwargs["past_key_values"] = past_key_values
        return original(hidden_states, mask, **kwargs)

    attn.forward = forward


def _patch_kv_heads(attn: nn.Module, kv_heads: int, config: GraniteMoeHybridConfig) -> None:
    bias = config.attention_bias
    attn.k_proj = nn.Linear(config.hidden_size, kv_heads * attn.head_dim, bias=bias)
    attn.v_proj = nn.Linear(config.hidden_size, kv_heads * attn.head_dim, bias=bias)
    attn.num_key_value_groups = config.num_attention_heads // kv_heads


def load_reference(model_dir: Path, *, eager: bool = True) -> GraniteMoeHybridForCausalLM:
    """`eager=False` keeps transformers' default attention implementation (for speed comparisons)."""
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    config = GraniteMoeHybridConfig.from_pretrained(model_dir)
    if eager:
        config._attn_implementation = "eager"
    model = GraniteMoeHybridForCausalLM(config).float().eval()

    num_layers = config.num_hidden_layers
    kv_heads = raw.get("kv_heads_per_layer") or [None] * num_layers
    windows = raw.get("sliding_window_per_layer") or [None] * num_layers
    for layer, kv, window in zip(model.model.layers, kv_heads, windows):
        if layer.self_attn is None:
            continue
        if kv is not None:
            _patch_kv_heads(layer.self_attn, kv, config)
        if window is not None:
            _patch_window(layer.self_attn, window)

    weights = load_file(str(model_dir / "model.safetensors"))
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(f"reference load: missing {missing}, unexpected {unexpected}")
    return model


@torch.inference_mode()
def reference_logits(model: GraniteMoeHybridForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] float32 logits of one full forward."""
    out = model(input_ids=torch.tensor([token_ids]), use_cache=False)
    return out.logits[0].float()
