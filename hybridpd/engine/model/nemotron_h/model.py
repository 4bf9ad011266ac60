"""`NemotronHLM`: Nemotron-H (`NemotronHForCausalLM`) over the paged hybrid KV cache.

Each layer is `h + mixer(norm(h))` with one mixer: Mamba2 or attention (the shared modules), an MLP
(`down(relu(up(x))^2)`), or an MoE: a sigmoid router with a score-correction bias, expert groups (the best
`topk_group` groups by the sum of their two best scores), the top-k experts among them, weights renormalised and
scaled, non-gated relu2 experts run by the grouped dispatch, plus a shared expert. Parameter names are those
transformers writes (`backbone.embeddings`, `backbone.layers.{i}.norm`, `backbone.layers.{i}.mixer...`, per-expert
`experts.{j}.up_proj`, `backbone.norm_f`, `lm_head`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridpd.engine.kv_cache.storage import KVCacheStorage
from hybridpd.engine.model.layers.attention import Attention
from hybridpd.engine.model.layers.norms import RMSNorm
from hybridpd.engine.model.kernels.linear import linear
from hybridpd.engine.model.layers.mamba2 import Mamba2Mixer
from hybridpd.engine.model.layers.moe import grouped_experts
from hybridpd.engine.model.nemotron_h.config import BlockType, NemotronHConfig
from hybridpd.engine.model.paged_lm import PagedCausalLM
from hybridpd.engine.model.step.context import StepContext


class ReLU2MLP(nn.Module):
    """`down_proj(relu(up_proj(x)) ** 2)`: an MLP layer, a routed expert, the shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = linear(x, self.up_proj.weight, self.up_proj.bias)
        return linear(F.relu(up).square_(), self.down_proj.weight, self.down_proj.bias)


class GroupedTopKRouter(nn.Module):
    """transformers' `NemotronHTopkRouter`: float32 sigmoid scores; selection by score + correction bias within the
    best groups; weights are the uncorrected scores of the chosen experts, renormalised (`norm_topk_prob`) and
    scaled by `routed_scaling_factor`."""

    def __init__(self, config: NemotronHConfig, dtype: torch.dtype) -> None:
        super().__init__()
        experts = config.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(experts, config.hidden_size, dtype=dtype))
        self.register_buffer("e_score_correction_bias", torch.zeros(experts, dtype=torch.float32))
        self.top_k, self.n_group, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.topk_group < self.n_group:
            grouped = choice.view(x.shape[0], self.n_group, -1)
            best_groups = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(self.topk_group, dim=-1).indices
            keep = torch.zeros(x.shape[0], self.n_group, dtype=torch.bool).scatter_(1, best_groups, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(x.shape[0], -1)
        top_ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, top_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return top_ids, weights * self.scaling


class NemotronHMoE(nn.Module):
    def __init__(self, config: NemotronHConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.gate = GroupedTopKRouter(config, dtype)
        self.experts = nn.ModuleList(
            ReLU2MLP(hidden, config.moe_intermediate_size, config.mlp_bias, dtype)
            for _ in range(config.n_routed_experts)
        )
        self.shared_experts = ReLU2MLP(hidden, config.moe_shared_expert_intermediate_size, config.mlp_bias, dtype)

    def _expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        return self.experts[expert].forward(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_ids, weights = self.gate.forward(x)
        routed = grouped_experts(x, top_ids, weights, self._expert, len(self.experts))
        return routed.add_(self.shared_experts.forward(x))


class NemotronHBlock(nn.Module):
    def __init__(self, config: NemotronHConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.block_type = config.block_types[layer_id]
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if self.block_type is BlockType.MAMBA:
            self.mixer = Mamba2Mixer(config.mamba, layer_id, dtype)
        elif self.block_type is BlockType.ATTENTION:
            self.mixer = Attention(config.attention[layer_id], layer_id, dtype)
        elif self.block_type is BlockType.MLP:
            self.mixer = ReLU2MLP(config.hidden_size, config.intermediate_size, config.mlp_bias, dtype)
        else:
            self.mixer = NemotronHMoE(config, dtype)
        self.uses_cache = self.block_type in (BlockType.MAMBA, BlockType.ATTENTION)

    def forward(self, h: torch.Tensor, ctx: StepContext, kv: KVCacheStorage) -> torch.Tensor:
        parts = self._modules  # see DecoderLayer.forward: no nn.Module __call__ per call
        normed = parts["norm"].forward(h)
        mixed = parts["mixer"].forward(normed, ctx, kv) if self.uses_cache else parts["mixer"].forward(normed)
        return h + mixed


class NemotronHBackbone(nn.Module):
    def __init__(self, config: NemotronHConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(NemotronHBlock(config, i, dtype) for i in range(len(config.block_types)))
        self.norm_f = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class NemotronHLM(PagedCausalLM):
    def __init__(self, config: NemotronHConfig, dtype: torch.dtype) -> None:
        super().__init__(dtype, rope=None)
        self.config = config
        self.backbone = NemotronHBackbone(config, dtype)
        self.attach(self.backbone.embeddings, self.backbone.layers, self.backbone.norm_f,
                    tie_word_embeddings=config.tie_word_embeddings)

    def cache_mixers(self) -> dict[int, Attention | Mamba2Mixer]:
        return {i: layer.mixer for i, layer in enumerate(self.backbone.layers) if layer.uses_cache}
