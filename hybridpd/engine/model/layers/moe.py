"""Mixture of experts: Granite-4.0-H's `block_sparse_moe` (router top-k, gated SiLU experts) and the grouped dispatch.

Parameter names and layouts are those of the published checkpoints (what transformers' `save_pretrained` writes):
`router.layer.weight` [E, H], `input_linear.weight` [E, 2I, H] (gate rows, then up rows), `output_linear.weight`
[E, H, I]. The router is transformers' `GraniteMoeHybridTopKGating`: float32 logits, the top-k of them, a softmax over
those k only, cast back to the activations' dtype.

Dispatch: the (token, slot) pairs are sorted by expert once, and each expert that received tokens runs two matmuls
over all of its rows (a grouped GEMM spelled as one matmul per expert); the weighted results are summed back into
their tokens with one `index_add_`. The Python loop runs over experts that have work, never over tokens. A step of
few rows (a decode step; how few depends on the size of the experts, `kernels/fused_moe.rows_worth_fusing`), float32
or bfloat16, runs its experts in one compiled call instead: there the dozen operations per expert cost more than
their arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridpd.engine.model.kernels.fused_moe import fused_moe_rows, rows_worth_fusing
from hybridpd.engine.model.kernels.linear import plain_linear

FUSED_DTYPES = (torch.float32, torch.bfloat16)   # what the compiled experts take (bfloat16 as its bits)

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


class TopKRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = plain_linear(x, self.layer.weight).float()
        top_logits, top_ids = logits.topk(self.top_k, dim=-1)
        return top_ids, torch.softmax(top_logits, dim=-1).to(x.dtype)


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
        expert_bytes = 3 * hidden_size * intermediate_size * num_experts * dtype.itemsize
        self.fused_max_rows = rows_worth_fusing(num_experts, top_k, expert_bytes)

    def _expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = plain_linear(rows, self.input_linear.weight[expert]).chunk(2, dim=-1)
        return plain_linear(F.silu(gate).mul_(up), self.output_linear.weight[expert])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_ids, top_weights = self.router.forward(x)
        w_in, w_out = self.input_linear.weight, self.output_linear.weight
        if (x.shape[0] <= self.fused_max_rows and x.dtype in FUSED_DTYPES and x.dtype == w_in.dtype == w_out.dtype
                and x.is_contiguous() and w_in.is_contiguous() and w_out.is_contiguous()):
            return fused_moe_rows(x, top_ids, top_weights, w_in, w_out)
        return grouped_experts(x, top_ids, top_weights, self._expert, self.num_experts)


class _StackedLinear(nn.Module):
    """One weight per expert, stacked: `weight` [E, out, in] (the checkpoint's tensor as it is)."""

    def __init__(self, num_experts: int, out_features: int, in_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, dtype=dtype))
