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
    """q [B, n, H, D], k/v [B, KVH, L, D], visible [B, n, L] -> [B, n, H * D].

    Query head h reads KV head h // (H // KVH), as transformers' `repeat_kv` does.
    """
    batch, n, heads, dim = q.shape
    kv_heads = k.shape[1]
    rep = heads // kv_heads
    # [B, KVH, rep * n, D]: the query heads sharing a KV head are stacked as rows of one matmul
    q = q.view(batch, n, kv_heads, rep, dim).permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, rep * n, dim)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, KVH, rep * n, L]
    scores = scores.view(batch, kv_heads, rep, n, -1).masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype).view(batch, kv_heads, rep * n, -1)
    out = torch.matmul(probs, v).view(batch, kv_heads, rep, n, dim)
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

    def _read_blocks(
        self, cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """blocks [B, nb] -> K and V as [B, kv_heads, nb * block_size, head_dim] (contiguous)."""
        batch, nb = blocks.shape

        def read(kv_index: int) -> torch.Tensor:
            pages = cache[blocks, kv_index]  # [B, nb, block_size, kv_heads, head_dim]
            return pages.permute(0, 3, 1, 2, 4).reshape(batch, self.num_kv_heads, -1, self.head_dim).to(dtype)

        return read(0), read(1)

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
            k_seq, v_seq = self._read_blocks(cache, d.blocks, x.dtype)
            out[d.rows] = grouped_attention(q[d.rows].unsqueeze(1), k_seq, v_seq, d.visible, self.scale).squeeze(1)
        for p in meta.prefills:
            k_seq, v_seq = self._read_blocks(cache, p.blocks[None], x.dtype)
            rows_of_seq = slice(p.row_start, p.row_start + p.num_rows)
            out[rows_of_seq] = grouped_attention(q[rows_of_seq][None], k_seq, v_seq, p.visible[None], self.scale)[0]
        return self.o_proj(out)
