"""`GraniteLM`: Granite-4.0-H (`GraniteMoeHybridForCausalLM`, dense or MoE) over the paged hybrid KV cache.

Parameter names equal transformers' `GraniteMoeHybridForCausalLM` (`model.layers.{i}.mamba.in_proj.weight`,
`lm_head.weight`, ...), so the checkpoint's state dict loads unchanged. Embedding, norms, projections and MLP
run over all T rows of a step at once; attention and Mamba use `StepContext` to batch decode rows.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridpd.engine.kv_cache.storage import KVCacheStorage
from hybridpd.engine.model.layers.attention import Attention
from hybridpd.engine.model.granite.config import GraniteConfig
from hybridpd.engine.model.layers.mlp import DenseMLP
from hybridpd.engine.model.layers.norms import RMSNorm
from hybridpd.engine.model.layers.rotary import RotaryEmbedding
from hybridpd.engine.model.layers.mamba2 import Mamba2Mixer
from hybridpd.engine.model.layers.moe import GraniteMoE
from hybridpd.engine.model.paged_lm import PagedCausalLM
from hybridpd.engine.model.step.context import StepContext


class DecoderLayer(nn.Module):
    def __init__(self, config: GraniteConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.shared_mlp = DenseMLP(config.hidden_size, config.shared_intermediate_size, dtype)
        self.has_experts = config.num_local_experts > 0
        if self.has_experts:  # transformers' attribute name; its output is added to the shared MLP's
            self.block_sparse_moe = GraniteMoE(
                config.hidden_size, config.intermediate_size, config.num_local_experts, config.num_experts_per_tok,
                dtype,
            )
        self.residual_multiplier = config.residual_multiplier
        # Exactly one of the two mixers, under transformers' attribute name.
        self.mixer_name = "self_attn" if config.layer_is_attention[layer_id] else "mamba"
        mixer = (Attention(config.attention_shape(layer_id), layer_id, dtype) if self.mixer_name == "self_attn"
                 else Mamba2Mixer(config.mamba_shape, layer_id, dtype))
        self.add_module(self.mixer_name, mixer)

    def forward(self, h: torch.Tensor, ctx: StepContext, kv: KVCacheStorage) -> torch.Tensor:
        # Submodules by `.forward`, looked up in `_modules`: nn.Module's __call__ and __getattr__ cost a few us per
        # call, which adds up over the ~90 calls of a decode step (no hooks are registered on these modules).
        parts = self._modules
        mixed = parts[self.mixer_name].forward(parts["input_layernorm"].forward(h), ctx, kv)
        h, normed = parts["post_attention_layernorm"].add_and_norm(h, mixed, self.residual_multiplier)
        mlp_out = parts["shared_mlp"].forward(normed)
        if self.has_experts:
            mlp_out = mlp_out.add_(parts["block_sparse_moe"].forward(normed))
        return torch.add(h, mlp_out, alpha=self.residual_multiplier)


class GraniteBackbone(nn.Module):
    """transformers' `model.` prefix: embeddings, decoder layers, final norm."""

    def __init__(self, config: GraniteConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class GraniteLM(PagedCausalLM):
    def __init__(self, config: GraniteConfig, dtype: torch.dtype) -> None:
        rope = RotaryEmbedding(config.head_dim, config.rope_theta) if config.position_embedding_type == "rope" else None
        super().__init__(dtype, rope)
        self.config = config
        self.embedding_multiplier = config.embedding_multiplier
        self.logits_scaling = config.logits_scaling
        self.model = GraniteBackbone(config, dtype)
        self.attach(self.model.embed_tokens, self.model.layers, self.model.norm,
                    tie_word_embeddings=config.tie_word_embeddings)

    def cache_mixers(self) -> dict[int, Attention | Mamba2Mixer]:
        return {i: layer.get_submodule(layer.mixer_name) for i, layer in enumerate(self.model.layers)}
