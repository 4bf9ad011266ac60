"""`FalconH1LM`: Falcon-H1 (`FalconH1ForCausalLM`) over the paged hybrid KV cache.

Each layer is `h + ssm_out * mamba(ssm_in * x) + attn_out * attention(attn_in * x)` with `x = input_layernorm(h)`,
then `h + mlp(pre_ff_layernorm(h))` with `mlp(x) = down(up(x) * silu(gate_mult * gate(x))) * down_mult`. Both
mixers of a layer keep a cache: the attention's KV blocks under cache id 2i and the Mamba state under 2i + 1, so
the KV cache sees two layers where the model has one. Parameter names are transformers' (`model.embed_tokens`,
`model.layers.{i}.mamba...`, `.self_attn...`, `.feed_forward.{gate,up,down}_proj`, `.input_layernorm`,
`.pre_ff_layernorm`, `model.final_layernorm`, `lm_head`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridpd.engine.kv_cache.storage import KVCacheStorage
from hybridpd.engine.model.falcon_h1.config import FalconH1Config
from hybridpd.engine.model.kernels.linear import linear
from hybridpd.engine.model.layers.attention import Attention
from hybridpd.engine.model.layers.mamba2 import Mamba2Mixer
from hybridpd.engine.model.layers.norms import RMSNorm
from hybridpd.engine.model.layers.rotary import RotaryEmbedding
from hybridpd.engine.model.paged_lm import PagedCausalLM
from hybridpd.engine.model.step.context import StepContext


def attention_cache_id(layer: int) -> int:
    return 2 * layer


def mamba_cache_id(layer: int) -> int:
    return 2 * layer + 1


class FalconH1MLP(nn.Module):
    def __init__(self, config: FalconH1Config, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(hidden, inner, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(inner, hidden, bias=bias, dtype=dtype)
        self.gate_multiplier, self.down_multiplier = config.mlp_multipliers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = linear(x, self.gate_proj.weight, self.gate_proj.bias)
        if self.gate_multiplier != 1.0:
            gate = gate.mul_(self.gate_multiplier)
        y = linear(x, self.up_proj.weight, self.up_proj.bias).mul_(F.silu(gate, inplace=True))
        out = linear(y, self.down_proj.weight, self.down_proj.bias)
        return out.mul_(self.down_multiplier) if self.down_multiplier != 1.0 else out


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, config: FalconH1Config, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.mamba = Mamba2Mixer(config.mamba, mamba_cache_id(layer_id), dtype)
        self.self_attn = Attention(config.attention, attention_cache_id(layer_id), dtype)
        self.feed_forward = FalconH1MLP(config, dtype)
        self.ssm_in, self.ssm_out = config.ssm_in_multiplier, config.ssm_out_multiplier
        self.attn_in, self.attn_out = config.attention_in_multiplier, config.attention_out_multiplier

    def forward(self, h: torch.Tensor, ctx: StepContext, kv: KVCacheStorage) -> torch.Tensor:
        parts = self._modules  # submodules by `.forward`: no nn.Module __call__ per call (see GraniteLM's layers)
        x = parts["input_layernorm"].forward(h)
        mamba = parts["mamba"].forward(x * self.ssm_in if self.ssm_in != 1.0 else x, ctx, kv)
        attn = parts["self_attn"].forward(x * self.attn_in if self.attn_in != 1.0 else x, ctx, kv)
        h = h + (mamba * self.ssm_out + attn * self.attn_out)  # transformers' order of the sums
        return h + parts["feed_forward"].forward(parts["pre_ff_layernorm"].forward(h))


class FalconH1Backbone(nn.Module):
    """transformers' `model.` prefix."""

    def __init__(self, config: FalconH1Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(FalconH1DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class FalconH1LM(PagedCausalLM):
    def __init__(self, config: FalconH1Config, dtype: torch.dtype) -> None:
        super().__init__(dtype, RotaryEmbedding(config.attention.head_dim, config.rope_theta))
        self.config = config
        self.embedding_multiplier = config.embedding_multiplier
        self.logits_multiplier = config.lm_head_multiplier
        self.model = FalconH1Backbone(config, dtype)
        self.attach(self.model.embed_tokens, self.model.layers, self.model.final_layernorm,
                    tie_word_embeddings=config.tie_word_embeddings)

    def cache_mixers(self) -> dict[int, Attention | Mamba2Mixer]:
        mixers: dict[int, Attention | Mamba2Mixer] = {}
        for layer in self.model.layers:
            mixers[layer.self_attn.layer_id] = layer.self_attn
            mixers[layer.mamba.layer_id] = layer.mamba
        return mixers
