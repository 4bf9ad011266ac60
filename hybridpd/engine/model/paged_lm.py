"""`PagedCausalLM`: what every model family shares over the paged hybrid KV cache.

A family (Granite-4.0-H, Nemotron-H, Falcon-H1) builds its own modules under transformers' parameter names and tells this
base where they are: the token embedding, the decoder layers (each `forward(h, ctx, kv)`), the final norm, the head,
and its two scalars (embedding multiplier, logits divisor). The KV specs come from the layers' mixers: an attention
mixer declares full attention or its window, a Mamba2 mixer its state slot; a layer without a cache (an MLP or MoE
layer of Nemotron-H) declares nothing. So the KV cache, scheduler and connector never learn which family they serve.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridpd.engine.kv_cache.spec import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from hybridpd.engine.kv_cache.storage import KVCacheStorage
from hybridpd.engine.model.kernels.linear import packs_products, plain_linear
from hybridpd.engine.model.kernels.packed import bucketed_rows
from hybridpd.engine.model.layers.attention import Attention
from hybridpd.engine.model.step.decode_kv import DecodeKV
from hybridpd.engine.model.step.forward_batch import ForwardBatch
from hybridpd.engine.model.layers.rotary import RotaryEmbedding
from hybridpd.engine.model.layers.mamba2 import Mamba2Mixer
from hybridpd.engine.model.step.context import build_step_context


class PagedCausalLM(nn.Module):
    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0      # a divisor of the logits (Granite)
    logits_multiplier: float = 1.0   # a factor of the logits (Falcon-H1's lm_head_multiplier)

    def __init__(self, dtype: torch.dtype, rope: RotaryEmbedding | None) -> None:
        super().__init__()
        self.dtype = dtype
        self.rope = rope
        self.decode_kv = DecodeKV()

    # -- what a family provides ---------------------------------------------------------------------------------
    def attach(self, embedding: nn.Embedding, layers: nn.ModuleList, norm: nn.Module, *,
               tie_word_embeddings: bool) -> None:
        """Where the family's modules are (registered under its own names, transformers'), and the head: its own
        [vocab, hidden] weight, or the embedding's when tied."""
        self._parts = (embedding, layers, norm)  # a tuple: not registered a second time under other names
        vocab, hidden = embedding.weight.shape
        self.lm_head = nn.Linear(hidden, vocab, bias=False, dtype=self.dtype)
        if tie_word_embeddings:
            self.lm_head.weight = embedding.weight

    def embedding(self) -> nn.Embedding:
        return self._parts[0]

    def decoder_layers(self) -> nn.ModuleList:
        return self._parts[1]

    def final_norm(self) -> nn.Module:
        return self._parts[2]

    def product_rows(self, rows: int) -> int:
        """The rows the layers' projections take for a step of `rows` token rows: where products pack (packed.py),
        rounded up to their buckets, so a step's rows up to there cost a small weight's product nothing more, and a
        large weight's one call instead of two (its last rows split rather than pad). Elsewhere `rows`."""
        return bucketed_rows(rows) if packs_products(self.dtype) else rows

    def cache_mixers(self) -> dict[int, Attention | Mamba2Mixer]:
        """Layer id -> the mixer of each layer that keeps a cache (attention or Mamba2)."""
        raise NotImplementedError

    def prepare_kernels(self) -> None:
        """The decode attention compiled for this model's head shapes now (at start-up), not at a step's first call
        (every other kernel is compiled when its module is imported)."""
        for mixer in self.cache_mixers().values():
            if isinstance(mixer, Attention):
                mixer.prepare_kernels()

    # -- shared ---------------------------------------------------------------------------------------------------
    def kv_cache_specs(self, block_size: int, mamba_interval: int) -> dict[int, KVCacheSpec]:
        """Layer id -> spec. Mamba slots: the conv state in float32 in either model dtype (a bfloat16 model's holds
        its bfloat16 inputs exactly), the SSM state in the model's dtype, as vLLM keeps it by default and
        transformers' cache does (the compiled kernel computes in float32 and rounds a bfloat16 state once per step
        where it stores it: a decode step reads and writes every running request's states, ~1.6 MB a layer in
        float32 on the 350M shape, which at batch 8 was ~40% of its bytes)."""
        specs: dict[int, KVCacheSpec] = {}
        for layer_id, mixer in self.cache_mixers().items():
            if isinstance(mixer, Mamba2Mixer):
                specs[layer_id] = MambaSpec(
                    block_size=mamba_interval, conv_state_shape=mixer.conv_state_shape,
                    ssm_state_shape=mixer.ssm_state_shape, dtypes=(torch.float32, self.dtype),
                )
            elif mixer.sliding_window is None:
                specs[layer_id] = FullAttentionSpec(
                    block_size=block_size, num_kv_heads=mixer.num_kv_heads, head_size=mixer.head_dim,
                    dtype=self.dtype,
                )
            else:
                specs[layer_id] = SlidingWindowSpec(
                    block_size=block_size, num_kv_heads=mixer.num_kv_heads, head_size=mixer.head_dim,
                    dtype=self.dtype, sliding_window=mixer.sliding_window,
                )
        return specs

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCacheStorage) -> torch.Tensor:
        """[S, vocab] float32 logits of the rows `batch.logits_indices`; writes the step's KV and Mamba states."""
        return self.logits(self.final_hidden(batch, kv))

    @torch.inference_mode()
    def final_hidden(self, batch: ForwardBatch, kv: KVCacheStorage) -> torch.Tensor:
        """[S, hidden] of the rows `batch.logits_indices` after the final norm (what `logits` takes); writes the
        step's KV and Mamba states."""
        rope = None
        if self.rope is not None:
            rope = self.rope.cos_sin(batch.positions, self.dtype, max(s.end for s in batch.seqs))
        self.decode_kv.bind(kv)
        ctx = build_step_context(batch, kv.groups, rope, self.decode_kv)
        h = self.embedding()(batch.input_ids)
        if self.embedding_multiplier != 1.0:
            h = h * self.embedding_multiplier
        try:
            for layer in self.decoder_layers():
                h = layer.forward(h, ctx, kv)
        except BaseException:
            self.decode_kv.end_runs()  # some layers may have appended, others not
            raise
        return self.final_norm().forward(h[batch.logits_indices])

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, vocab] float32 logits of final hidden rows."""
        logits = plain_linear(hidden, self.lm_head.weight)
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        if self.logits_multiplier != 1.0:
            logits = logits * self.logits_multiplier
        return logits.float()
