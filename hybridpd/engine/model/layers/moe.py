"""Mixture of experts: Granite-4.0-H's `block_sparse_moe` (router top-k, gated SiLU experts) and the grouped dispatch.

Parameter names and layouts are those of the published checkpoints (what transformers' `save_pretrained` writes):
`router.layer.weight` [E, H], `input_linear.weight` [E, 2I, H] (gate rows, then up rows), `output_linear.weight`
[E, H, I]. The router is transformers' `GraniteMoeHybridTopKGating`: float32 logits, the top-k of them, a softmax over
those k only, cast back to the activations' dtype (for float32 and bfloat16 one compiled pass: kernels/fused_router.py).

Dispatch: the (token, slot) pairs are sorted by expert once, and each expert that received tokens runs two matmuls
over all of its rows (a grouped GEMM spelled as one matmul per expert); the weighted results are summed back into
their tokens with one `index_add_`. The Python loop runs over experts that have work, never over tokens. A step of
few rows (a decode step; how few depends on the size of the experts, `kernels/fused_moe.rows_worth_fusing`), float32
or bfloat16, is routed and runs its experts in one compiled call instead: there the dozen operations per expert cost
more than their arithmetic.

Every expert at once (`every_expert`): in bfloat16 on a CPU with AMX (`linear.products_on_tiles`), a layer whose experts
stay in cache (`fused_moe.RESIDENT_BYTES`) runs a step of EVERY_EXPERT_MIN_ROWS rows or more as two products over all of
its experts side by side, the routing weights of the experts a row did not choose zero: E / k times the arithmetic of
the chosen experts, in two packed products on the tiles instead of the compiled kernel's float32 loops or a dozen small
operations per expert; between them one compiled pass (`silu_times_weighted`) computes the chosen experts' weighted
activations and zeros the others' (granite-moe served 1.05x the tokens a second with it than with torch's three
operations over strided views, EPYC with AVX512-BF16). Measured on the Xeon with AMX (benchmarks/README.md), one thread,
the granite-moe preset's layer (16 experts of 128 x 64, top-4), ms at 24 / 32 / 48 / 256 / 1,024 / 2,048 rows: 0.42 /
0.47 / 0.57 / 1.4 / 3.9 / 7.3 against the compiled kernel's 0.49 / 0.60 / 0.87 / 4.7 (to 256 rows) and the grouped
dispatch's 7.7 / 11.0 / 13.4 (from 256); at 16 rows the two were even (0.34), at 8 the kernel ahead (0.20 against 0.27).
With 32 experts of that size (8 x the chosen arithmetic) still ahead from 256 rows (2.9 against 3.8 and 10.4; 15.7
against 21.2 at 2,048). A layer whose experts stream from memory reads them once per step either way, but its arithmetic
grows faster than the reads save (64 experts of 256 x 128, top-6: 55 against 16 ms at 1,024 rows), so it keeps the
grouped dispatch. In float32, MKL's products gave no such margin (2.5 against 3.1 and 2.5 ms at 256 rows, slower from
1,024), nor did packed float32 products on the EPYC with AVX-512 (packed.py): there an engine on the preset served 0.91x
the tokens a second with every expert at once allowed from 24 rows (`moe_paths.py`). The AMX figures above are against
the compiled kernel that read an expert's weights once per row; against the one that reads them once per eight rows, on
the Xeon with AVX512-BF16 and no AMX, bfloat16, the preset's engine served 0.89x the tokens a second with every expert
at once allowed (`moe_paths.py --rounds 4`; one layer, every expert 0.40 / 0.52 / 2.6 ms at 16 / 24 / 256 rows, the
kernel 0.18 / 0.25 / 2.0), so there the kernel keeps its rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridpd.engine.model.kernels.bf16_bits import KERNEL_DTYPES
from hybridpd.engine.model.kernels.fused_moe import RESIDENT_BYTES, routed_moe_rows, rows_worth_fusing
from hybridpd.engine.model.kernels.fused_router import top_k_route
from hybridpd.engine.model.kernels.linear import packs_products, plain_linear, products_on_tiles
from hybridpd.engine.model.kernels.silu import silu_times_weighted

FUSED_DTYPES = KERNEL_DTYPES   # what the compiled experts take (bfloat16 as its bits)
EVERY_EXPERT_MIN_ROWS = 24   # from this many rows a resident layer's bfloat16 experts run all at once (above)

ExpertForward = Callable[[int, torch.Tensor], torch.Tensor]  # (expert index, its rows [n, H]) -> [n, H]


def grouped_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    expert_forward: ExpertForward, num_experts: int) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for every token t, grouped by expert.

    x [T, H]; topk_ids, topk_weights [T, K]. Every expert's rows are one contiguous slice of the sorted pairs."""
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    token_of = order // topk_ids.shape[1]
    weights = topk_weights.reshape(-1)[order].unsqueeze(-1)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        tokens = token_of[rows]
        y = expert_forward(expert, x.index_select(0, tokens))
        out.index_add_(0, tokens, y.mul_(weights[rows].to(y.dtype)))
        start += count
    return out


def every_expert(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_in: torch.Tensor,
                 w_out_side_by_side: torch.Tensor) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) as two products over every expert: `w_in` [E, 2I, H]
    (gate rows, then up rows, per expert), `w_out_side_by_side` [H, E * I] (expert e's down projection in columns
    e * I to (e + 1) * I); float32 or bfloat16. An expert a row did not choose gets the weight 0 (its activations
    zeros, `silu_times_weighted`)."""
    rows = x.shape[0]
    experts, double_inter, _ = w_in.shape
    gate_up = plain_linear(x, w_in.reshape(experts * double_inter, -1))
    weights = torch.zeros((rows, experts), dtype=x.dtype).scatter_(1, topk_ids, topk_weights.to(x.dtype))
    return plain_linear(silu_times_weighted(gate_up, weights), w_out_side_by_side)


class TopKRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the top-k experts' ids [T, k], largest logit first; their weights [T, k] in float32, holding values of
        x's dtype): one compiled pass for float32 and bfloat16 (kernels/fused_router.py), else torch's operations."""
        weight = self.layer.weight
        if x.dtype in KERNEL_DTYPES and weight.dtype == x.dtype and x.is_contiguous() and weight.is_contiguous():
            return top_k_route(x, weight, self.top_k)
        logits = plain_linear(x, weight).float()
        top_logits, top_ids = logits.topk(self.top_k, dim=-1)
        return top_ids, torch.softmax(top_logits, dim=-1).to(x.dtype).float()


class GraniteMoE(nn.Module):
    """`block_sparse_moe`: the routed experts (the layer adds the shared MLP's output to this)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.router = TopKRouter(hidden_size, num_experts, top_k, dtype)
        self.input_linear = _StackedLinear(num_experts, 2 * intermediate_size, hidden_size, dtype)
        self.output_linear = _StackedLinear(num_experts, hidden_size, intermediate_size, dtype)
        # Up to this many rows a layer runs its experts in one compiled call (fused_moe.py).
        expert_elements = 3 * hidden_size * intermediate_size * num_experts
        self.fused_max_rows = rows_worth_fusing(expert_elements * dtype.itemsize)
        # From this many bfloat16 rows on packed products every expert at once (`every_expert`; None: never).
        self.resident = expert_elements * torch.bfloat16.itemsize <= RESIDENT_BYTES   # its bfloat16 experts in cache
        self.every_expert_min_rows = (EVERY_EXPERT_MIN_ROWS if self.resident and products_on_tiles(torch.bfloat16)
                                      else None)
        self._side_by_side_of: tuple[torch.Tensor, int] | None = None
        self._side_by_side: torch.Tensor | None = None

    def _expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = plain_linear(rows, self.input_linear.weight[expert]).chunk(2, dim=-1)
        return plain_linear(F.silu(gate).mul_(up), self.output_linear.weight[expert])

    def _w_out_side_by_side(self) -> torch.Tensor:
        """`output_linear.weight` [E, H, I] as [H, E * I], copied again only when the parameter was replaced or
        written in place (a reloaded checkpoint). Made outside inference mode: its pack (packed.py) reads
        its version counter."""
        weight = self.output_linear.weight
        held = self._side_by_side_of
        if self._side_by_side is None or held is None or held[0] is not weight or held[1] != weight._version:
            with torch.inference_mode(False), torch.no_grad():
                self._side_by_side = weight.permute(1, 0, 2).reshape(weight.shape[1], -1).contiguous()
            self._side_by_side_of = (weight, weight._version)
        return self._side_by_side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w_in, w_out, router = self.input_linear.weight, self.output_linear.weight, self.router.layer.weight
        every_from = self.every_expert_min_rows
        every = (every_from is not None and x.shape[0] >= every_from and x.dtype == torch.bfloat16
                 and packs_products(x.dtype) and x.dtype == w_in.dtype == w_out.dtype)
        if (not every and x.shape[0] <= self.fused_max_rows and x.dtype in FUSED_DTYPES
                and x.dtype == w_in.dtype == w_out.dtype == router.dtype and x.is_contiguous()
                and w_in.is_contiguous() and w_out.is_contiguous()):
            return routed_moe_rows(x, router, self.router.top_k, w_in, w_out)   # the router's gating inside
        top_ids, top_weights = self.router.forward(x)
        if every:
            return every_expert(x, top_ids, top_weights, w_in, self._w_out_side_by_side())
        return grouped_experts(x, top_ids, top_weights, self._expert, self.num_experts)


class _StackedLinear(nn.Module):
    """One weight per expert, stacked: `weight` [E, out, in] (the checkpoint's tensor as it is)."""

    def __init__(self, num_experts: int, out_features: int, in_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, dtype=dtype))
