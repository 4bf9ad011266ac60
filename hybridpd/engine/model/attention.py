"""Attention over the paged KV cache: full or sliding window, per-layer KV heads (GQA), Granite's scale.

Each step first writes the new rows' K/V (after RoPE) into the cache at
`(block_tables[g][pos // block_size], pos % block_size)`, then every query reads its keys back from the cache:
`[0, pos]` for full attention, `(pos - W, pos]` for a window.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridpd.engine.kv_cache.storage import KVCacheStorage
from hybridpd.engine.model.config import HybridConfig
from hybridpd.engine.model.layers import RotaryEmbedding
from hybridpd.engine.model.step_context import AttentionGroupMeta, StepContext


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, n, H, D], k/v [B, L, KVH, D], visible [B, n, L] -> [B, n, H * D].

    Query head h reads KV head h // (H // KVH), as transformers' `repeat_kv` does.
    """
    batch, n, heads, dim = q.shape
    kv_heads = k.shape[2]
    q = q.view(batch, n, kv_heads, heads // kv_heads, dim).permute(0, 2, 3, 1, 4)  # [B, KVH, rep, n, D]
    k = k.permute(0, 2, 1, 3).unsqueeze(2)  # [B, KVH, 1, L, D]
    v = v.permute(0, 2, 1, 3).unsqueeze(2)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, KVH, rep, n, L]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v)  # [B, KVH, rep, n, D]
    return out.permute(0, 3, 1, 2, 4).reshape(batch, n, heads * dim)


class Attention(nn.Module):
    def __init__(self, config: HybridConfig, layer_id: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.kv_heads_per_layer[layer_id]
        self.head_dim = config.head_dim
        self.scale = config.attention_multiplier
        bias = config.attention_bias
        hidden, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(hidden, kv_size, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(hidden, kv_size, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(q_size, hidden, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor, ctx: StepContext, kv: KVCacheStorage) -> torch.Tensor:
        rows = x.shape[0]
        q = self.q_proj(x).view(rows, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(rows, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(rows, self.num_kv_heads, self.head_dim)
        if ctx.rope_cos is not None:
            q = RotaryEmbedding.apply(q, ctx.rope_cos, ctx.rope_sin)
            k = RotaryEmbedding.apply(k, ctx.rope_cos, ctx.rope_sin)

        meta = ctx.groups[kv.slot(self.layer_id).group_id]
        if not isinstance(meta, AttentionGroupMeta):
            raise TypeError(f"layer {self.layer_id} is attention but its KV group is not")
        cache = kv.attention_view(self.layer_id)  # [blocks, 2, block_size, kv_heads, head_dim]
        cache[meta.write_blocks, 0, meta.write_offsets] = k.to(cache.dtype)
        cache[meta.write_blocks, 1, meta.write_offsets] = v.to(cache.dtype)

        out = torch.empty(rows, self.num_heads * self.head_dim, dtype=x.dtype)
        if meta.decode is not None:
            d = meta.decode
            keys = cache[d.blocks, :, d.offsets].to(x.dtype)  # [Sd, L, 2, kv_heads, head_dim]
            out[d.rows] = grouped_attention(
                q[d.rows].unsqueeze(1), keys[:, :, 0], keys[:, :, 1], d.visible, self.scale
            ).squeeze(1)
        for p in meta.prefills:
            keys = cache[p.blocks, :, p.offsets].to(x.dtype)  # [L, 2, kv_heads, head_dim]
            q_seq = q[p.row_start : p.row_start + p.num_rows]
            out[p.row_start : p.row_start + p.num_rows] = grouped_attention(
                q_seq[None], keys[None, :, 0], keys[None, :, 1], p.visible[None], self.scale
            )[0]
        return self.o_proj(out)
