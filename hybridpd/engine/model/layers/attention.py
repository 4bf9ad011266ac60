"""Attention over the paged KV cache: full or sliding window, per-layer KV heads (GQA), Granite's scale.

Each step first writes the new rows' K/V (after RoPE) into the cache at
`(block_tables[g][pos // block_size], pos % block_size)`, then every query reads its keys back from the cache:
`[0, pos]` for full attention, `(pos - W, pos]` for a window. Sequences with nothing computed before this step
read their keys straight from this step's K/V instead, batched when they have the same length, in chunks of
queries that each read only the keys they can see (`attention_meta._query_chunks`); a long one's full attention,
and rows after many earlier keys, go through oneDNN's products where MKL runs generic code
(`kernels/product_attention.py`). Decode rows read their keys
from contiguous buffers that keep them between steps (`decode_kv.py`), appending this step's keys there too,
instead of gathering every block again; only a sequence the buffers do not hold yet gathers its blocks. On one
thread the decode rows attend over the buffers through a compiled kernel (`kernels/decode_attention.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridpd.engine.kv_cache.storage import KVCacheStorage
from hybridpd.engine.model.kernels import product_attention
from hybridpd.engine.model.kernels.buffer_moves import move_rows_
from hybridpd.engine.model.kernels.bf16_bits import KERNEL_DTYPES
from hybridpd.engine.model.kernels import decode_attention as decode_kernel
from hybridpd.engine.model.kernels.decode_attention import decode_attention
from hybridpd.engine.model.kernels.fused_decode_write import rope_and_write_, rope_and_write_paged_
from hybridpd.engine.model.kernels.linear import linear, plain_linear
from hybridpd.engine.model.layers.rotary import RotaryEmbedding
from hybridpd.engine.model.shapes import AttentionShape
from hybridpd.engine.model.step.attention_meta import AttentionDecode, AttentionGroupMeta
from hybridpd.engine.model.step.context import StepContext
from hybridpd.engine.model.step.decode_kv import DecodeKV, DecodeKVPlan


class Attention(nn.Module):
    def __init__(self, shape: AttentionShape, cache_id: int, dtype: torch.dtype) -> None:
        """`cache_id`: this layer's entry in the KV cache (its layer id, or any id unique among the model's caches)."""
        super().__init__()
        self.layer_id = cache_id
        self.num_heads = shape.num_heads
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.sliding_window = shape.sliding_window  # None: full attention
        self.scale = shape.scale
        self.key_multiplier = shape.key_multiplier
        bias = shape.bias
        hidden, q_size, kv_size = shape.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(hidden, kv_size, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(hidden, kv_size, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(q_size, hidden, bias=bias, dtype=dtype)
        # One [q + 2 kv, hidden] weight for the three projections. q/k/v_proj keep their names (the checkpoint's),
        # but their parameters become views of it: loading a state dict copies into them in place, which fills
        # the fused weight, so it can never go stale.
        self.register_buffer("qkv_weight", self._fuse("weight"), persistent=False)
        self.register_buffer("qkv_bias", self._fuse("bias") if bias else None, persistent=False)
        self.split = (q_size + kv_size, kv_size)
        self.q_size = q_size

    def prepare_kernels(self) -> None:
        """Compile the decode kernel this layer will call (on one thread, in a dtype it takes) before the first step."""
        if _decode_kernel_for(self.qkv_weight.dtype):
            decode_kernel.prepare(self.head_dim, self.num_heads // self.num_kv_heads)

    def _fuse(self, name: str) -> torch.Tensor:
        projections = (self.q_proj, self.k_proj, self.v_proj)
        fused = torch.cat([p.get_parameter(name).detach() for p in projections])
        start = 0
        for p in projections:
            size = p.get_parameter(name).shape[0]
            setattr(p, name, nn.Parameter(fused[start : start + size], requires_grad=False))
            start += size
        return fused

    def _read_blocks(
        self, rows: tuple[torch.Tensor, torch.Tensor], blocks: torch.Tensor, batch: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """blocks [batch * nb] -> K and V as [batch, kv_heads, nb * block_size, head_dim] (strided views).

        `rows` are the layer's K and V block rows (`KVCacheStorage.attention_rows`): one row-gather per half
        copies whole blocks; the per-head order comes from a transposed view, not from a second copy."""
        k, v = (r.index_select(0, blocks).view(batch, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
                for r in rows)
        if k.dtype != dtype:
            k, v = k.to(dtype), v.to(dtype)
        return k, v

    def forward(self, x: torch.Tensor, ctx: StepContext, kv: KVCacheStorage) -> torch.Tensor:
        rows = x.shape[0]
        # q | k | v side by side in one row of the projection; RoPE rotates q and k in place (the projection is
        # ours), so k and v stay adjacent and go into the cache in one write.
        qkv = linear(x, self.qkv_weight, self.qkv_bias)
        q_size = self.q_size
        if self.key_multiplier != 1.0:
            qkv[:, q_size : self.split[0]].mul_(self.key_multiplier)
        meta = ctx.groups[kv.slot(self.layer_id).group_id]
        if not isinstance(meta, AttentionGroupMeta):
            raise TypeError(f"layer {self.layer_id} is attention but its KV group is not")
        cache = kv.attention_view(self.layer_id)  # [blocks, 2, block_size, kv_heads, head_dim]
        plan = meta.decode_kv if ctx.decode_kv is not None else None
        if plan is not None and meta.decode_rows is None:  # only decode rows, all of them; earlier keys buffered
            att = self._decode_only(qkv, ctx, meta, plan, cache, kv)
            return plain_linear(att, self.o_proj.weight, self.o_proj.bias)
        k_and_v = self._rope_and_write(qkv, ctx, meta, cache)
        d = meta.decode
        if d is not None and not meta.prefills and not meta.fresh:  # only decode rows: all rows, in order
            k_seq, v_seq = self._read_blocks(kv.attention_rows(self.layer_id), d.blocks, rows, x.dtype)
            # The query heads sharing a KV head are the "query rows" of that head: no KV repeat needed.
            q_dec = qkv[:, :q_size].view(rows, self.num_kv_heads, -1, self.head_dim)
            att = F.scaled_dot_product_attention(q_dec, k_seq, v_seq, attn_mask=d.bias, scale=self.scale)
            return plain_linear(att.reshape(rows, q_size), self.o_proj.weight, self.o_proj.bias)

        q = qkv[:, :q_size].view(rows, self.num_heads, self.head_dim)
        k, v = k_and_v[:, 0], k_and_v[:, 1]
        out = torch.empty(rows, q_size, dtype=x.dtype)
        if plan is not None:  # decode rows beside prefill rows, from the buffers
            at = meta.decode_rows
            k_buf, v_buf = self._ready_buffers(plan, d, ctx.decode_kv, kv, qkv.dtype)
            k_buf[plan.rows, :, plan.positions] = k_and_v[at, 0]
            v_buf[plan.rows, :, plan.positions] = k_and_v[at, 1]
            out[at] = self._attend_buffers(qkv[at], plan, k_buf, v_buf)
        elif d is not None:
            num = d.rows.shape[0]
            k_seq, v_seq = self._read_blocks(kv.attention_rows(self.layer_id), d.blocks, num, x.dtype)
            q_dec = q[d.rows].view(num, self.num_kv_heads, -1, self.head_dim)
            att = F.scaled_dot_product_attention(q_dec, k_seq, v_seq, attn_mask=d.bias, scale=self.scale)
            out[d.rows] = att.reshape(num, q_size)
        for run in meta.fresh:
            rows_of_run = slice(run.row_start, run.row_start + run.num_seqs * run.num_rows)
            out_run = out[rows_of_run].view(run.num_seqs, run.num_rows, self.num_heads, self.head_dim)
            if self._by_products(q, run.num_rows, run.num_rows, run.num_seqs):
                for i in range(run.num_seqs):
                    seq = slice(run.row_start + i * run.num_rows, run.row_start + (i + 1) * run.num_rows)
                    product_attention.causal_attention(q[seq], k[seq], v[seq], out_run[i], 0, self.scale)
                continue
            shape = (run.num_seqs, run.num_rows, -1, self.head_dim)
            q_run, k_run, v_run = (t[rows_of_run].reshape(shape).transpose(1, 2) for t in (q, k, v))
            for c in run.chunks:
                out_run[:, c.q_start : c.q_end] = F.scaled_dot_product_attention(
                    q_run[:, :, c.q_start : c.q_end], k_run[:, :, c.k_start : c.q_end],
                    v_run[:, :, c.k_start : c.q_end], attn_mask=c.bias, is_causal=c.bias is None,
                    scale=self.scale, enable_gqa=True,
                ).transpose(1, 2)
        for p in meta.prefills:
            k_seq, v_seq = self._read_blocks(kv.attention_rows(self.layer_id), p.blocks, 1, x.dtype)
            rows_of_seq = slice(p.row_start, p.row_start + p.num_rows)
            if self._by_products(q, p.num_rows, p.first + p.num_rows):
                out_seq = out[rows_of_seq].view(p.num_rows, self.num_heads, self.head_dim)
                product_attention.causal_attention(q[rows_of_seq], k_seq[0].transpose(0, 1),
                                                   v_seq[0].transpose(0, 1), out_seq, p.first, self.scale)
                continue
            q_seq = q[rows_of_seq].transpose(0, 1)[None]  # [1, heads, n, head_dim]
            att = F.scaled_dot_product_attention(
                q_seq, k_seq, v_seq, attn_mask=p.bias, scale=self.scale, enable_gqa=True
            )
            out[rows_of_seq] = att[0].transpose(0, 1).reshape(p.num_rows, -1)
        return linear(out, self.o_proj.weight, self.o_proj.bias)

    def _by_products(self, q: torch.Tensor, rows: int, keys: int, sequences: int = 1) -> bool:
        """Whether `sequences` of `rows` prefill rows over `keys` keys each attend through oneDNN's products
        (product_attention.py): full attention only (a window's few keys stay with SDPA)."""
        return self.sliding_window is None and product_attention.takes(q.dtype, rows, keys, sequences)

    def _rope_and_write(
        self, qkv: torch.Tensor, ctx: StepContext, meta: AttentionGroupMeta, cache: torch.Tensor
    ) -> torch.Tensor:
        """RoPE on q and k in place, every row's K and V into the paged cache -> the K/V view [rows, 2, kv, D]: for a
        float32 or bfloat16 model one compiled pass (fused_decode_write.py), else the torch operations."""
        rows = qkv.shape[0]
        if ctx.rope_cos is not None and _kernel_takes(qkv, cache, ctx.rope_cos):
            rope_and_write_paged_(qkv, ctx.rope_cos, ctx.rope_sin, self.num_heads, cache, meta.write_blocks,
                                  meta.write_offsets)
            return qkv[:, self.q_size :].view(rows, 2, self.num_kv_heads, self.head_dim)
        if ctx.rope_cos is not None:
            RotaryEmbedding.apply_(qkv[:, : self.split[0]].view(rows, -1, self.head_dim), ctx.rope_cos, ctx.rope_sin)
        k_and_v = qkv[:, self.q_size :].view(rows, 2, self.num_kv_heads, self.head_dim)
        cache[meta.write_blocks, :, meta.write_offsets] = k_and_v.to(cache.dtype)
        return k_and_v

    def _decode_only(
        self, qkv: torch.Tensor, ctx: StepContext, meta: AttentionGroupMeta, plan: DecodeKVPlan,
        cache: torch.Tensor, kv: KVCacheStorage,
    ) -> torch.Tensor:
        """A step of decode rows only, served by DecodeKV -> [rows, q_size]. The buffers are made ready first
        (moves, fills from the paged cache: the column at each row's position is stale there and written next),
        then RoPE, the paged write and the buffer append: for a float32 or bfloat16 model one compiled pass
        (fused_decode_write.py), else the torch operations."""
        k_buf, v_buf = self._ready_buffers(plan, meta.decode, ctx.decode_kv, kv, qkv.dtype)
        if ctx.rope_cos is not None and _kernel_takes(qkv, cache, k_buf, ctx.rope_cos):
            rope_and_write_(qkv, ctx.rope_cos, ctx.rope_sin, self.num_heads, cache, meta.write_blocks,
                            meta.write_offsets, k_buf, v_buf, plan.positions)
        else:
            k_and_v = self._rope_and_write(qkv, ctx, meta, cache)
            k_buf[plan.rows, :, plan.positions] = k_and_v[:, 0]
            v_buf[plan.rows, :, plan.positions] = k_and_v[:, 1]
        return self._attend_buffers(qkv, plan, k_buf, v_buf)

    def _ready_buffers(
        self, plan: DecodeKVPlan, fills: AttentionDecode | None, decode_kv: DecodeKV, kv: KVCacheStorage,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's DecodeKV buffers with the plan's held rows moved up and its filled rows rebuilt from the
        paged cache."""
        k_buf, v_buf = decode_kv.buffers(self.layer_id, plan, self.num_kv_heads, self.head_dim, dtype)
        if plan.moves:  # ascending: a target is never a row still to move. The keys each row holds move; past
            # them the target keeps its earlier keys or zeros (finite), which the mask hides
            move_rows_(k_buf, v_buf, *plan.move_arrays)
        if fills is not None:
            k_seq, v_seq = self._read_blocks(kv.attention_rows(self.layer_id), fills.blocks, len(plan.fills), dtype)
            columns = min(k_seq.shape[2], k_buf.shape[2])
            for i, row in enumerate(plan.fills):   # a copy per row: a few rows, and a plain copy beats an indexed put
                k_buf[row, :, :columns] = k_seq[i, :, :columns]
                v_buf[row, :, :columns] = v_seq[i, :, :columns]
        return k_buf, v_buf

    def _attend_buffers(
        self, qkv: torch.Tensor, plan: DecodeKVPlan, k_buf: torch.Tensor, v_buf: torch.Tensor
    ) -> torch.Tensor:
        """The decode rows' queries (qkv: theirs only, in the plan's row order) over the buffers in place: on one
        thread through the compiled kernel (each row over its own keys), else through SDPA."""
        if _kernel_attends(qkv):
            return decode_attention(qkv, k_buf, v_buf, plan.first_keys, plan.end_keys, self.num_heads, self.scale)
        rows, q_size = qkv.shape[0], self.q_size
        q_dec = qkv[:, :q_size].view(rows, self.num_kv_heads, -1, self.head_dim)
        if len(plan.runs) == 1:
            keys = slice(plan.start, plan.length)
            att = F.scaled_dot_product_attention(
                q_dec, k_buf[:rows, :, keys], v_buf[:rows, :, keys], attn_mask=plan.bias, scale=self.scale
            )
            return att.reshape(rows, q_size)
        att = torch.empty_like(q_dec)
        for first_row, end_row, first_key, end_key in plan.runs:   # each run of rows over the columns it needs
            run, keys = slice(first_row, end_row), slice(first_key, end_key)
            att[run] = F.scaled_dot_product_attention(
                q_dec[run], k_buf[run, :, keys], v_buf[run, :, keys],
                attn_mask=plan.bias[run, :, :, first_key - plan.start : end_key - plan.start], scale=self.scale,
            )
        return att.reshape(rows, q_size)


def _decode_kernel_for(dtype: torch.dtype) -> bool:
    """Whether decode rows of `dtype` attend through the compiled kernel: one thread (SDPA splits its work over more),
    a dtype it takes."""
    return dtype in KERNEL_DTYPES and torch.get_num_threads() == 1


def _kernel_attends(qkv: torch.Tensor) -> bool:
    """These decode rows' attention through the compiled kernel (`_decode_kernel_for`, and rows as it reads them)."""
    return _decode_kernel_for(qkv.dtype) and qkv.is_contiguous()


def _kernel_takes(*tensors: torch.Tensor) -> bool:
    """The compiled RoPE and writes take tensors of one dtype they know."""
    return tensors[0].dtype in KERNEL_DTYPES and all(t.dtype == tensors[0].dtype for t in tensors)
