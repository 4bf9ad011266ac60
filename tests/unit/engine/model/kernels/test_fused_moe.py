"""The fused experts of a few rows, routed in the same pass, agree with the router and the grouped dispatch
(layers/moe.py) to float32 rounding (bfloat16 weights: with the float32 sums of their values, rounded once), and the
layer sends them only float32 or bfloat16 steps of at most as many rows as its experts' size makes worth it."""

from __future__ import annotations

import pytest
import torch

from hybridpd.engine.model.kernels.fused_moe import (RESIDENT_BYTES, RESIDENT_MAX_ROWS, STREAMED_MAX_ROWS,
                                                     routed_moe_rows, rows_worth_fusing)
from hybridpd.engine.model.layers import moe as moe_module
from hybridpd.engine.model.layers.moe import GraniteMoE, grouped_experts


def _layer(hidden: int, inter: int, experts: int, top_k: int, seed: int) -> GraniteMoE:
    layer = GraniteMoE(hidden, inter, experts, top_k, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return layer


def _routed(layer: GraniteMoE, x: torch.Tensor) -> torch.Tensor:
    return routed_moe_rows(x, layer.router.layer.weight, layer.router.top_k, layer.input_linear.weight,
                           layer.output_linear.weight)


@pytest.mark.parametrize("rows, hidden, inter, experts, top_k", [
    (1, 16, 8, 4, 1), (5, 32, 24, 6, 2), (16, 128, 64, 16, 4), (3, 40, 12, 3, 3), (64, 24, 16, 8, 2),
    (29, 24, 16, 1, 1),       # one expert: rows by eight, then four and one
    (7, 24, 16, 1, 1), (6, 24, 16, 1, 1), (2, 24, 16, 1, 1),
    (23, 256, 128, 16, 4),    # streamed from memory (6 MiB): the last rows padded to eight
])
def test_agrees_with_the_grouped_dispatch(rows, hidden, inter, experts, top_k):
    layer = _layer(hidden, inter, experts, top_k, seed=rows + hidden)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows))
    top_ids, top_weights = layer.router.forward(x)
    got = _routed(layer, x)
    expected = grouped_experts(x, top_ids, top_weights, layer._expert, experts)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, hidden, inter, experts, top_k", [
    (1, 16, 8, 4, 1), (5, 32, 24, 6, 2), (16, 128, 64, 16, 4), (27, 24, 16, 1, 1),
])
def test_bfloat16_weights_are_summed_in_float32_and_rounded_once(rows, hidden, inter, experts, top_k):
    layer = _layer(hidden, inter, experts, top_k, seed=rows + hidden).to(torch.bfloat16)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    top_ids, top_weights = layer.router.forward(x)
    got = _routed(layer, x)
    wide = layer.float()
    expected = grouped_experts(x.float(), top_ids, top_weights.float(), wide._expert, experts).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7, atol=1e-6)   # one bfloat16 step


@pytest.mark.parametrize("expert_bytes, rows", [
    (3 * 128 * 64 * 16 * 4, RESIDENT_MAX_ROWS),   # the granite-moe preset: its experts stay in cache
    (RESIDENT_BYTES, RESIDENT_MAX_ROWS),
    (RESIDENT_BYTES + 1, STREAMED_MAX_ROWS),       # streamed from memory: fewer rows
    (3 * 1536 * 512 * 64 * 4, STREAMED_MAX_ROWS),  # Granite-4.0-H-Tiny
])
def test_rows_worth_fusing_follow_the_size_of_the_experts(expert_bytes, rows):
    assert rows_worth_fusing(expert_bytes) == rows


@pytest.mark.parametrize("rows, dtype, fused", [
    (1, torch.float32, True), (RESIDENT_MAX_ROWS, torch.float32, True),
    (RESIDENT_MAX_ROWS + 1, torch.float32, False),   # a prefill: the grouped GEMMs
    (4, torch.bfloat16, True), (RESIDENT_MAX_ROWS + 1, torch.bfloat16, False),
    (4, torch.float64, False),
])
def test_the_layer_fuses_only_few_float32_or_bfloat16_rows(monkeypatch, rows, dtype, fused):
    calls = []
    monkeypatch.setattr(moe_module, "routed_moe_rows", lambda *a: calls.append(1) or routed_moe_rows(*a))
    layer = _layer(32, 16, 4, 2, seed=1).to(dtype)
    assert layer.fused_max_rows == RESIDENT_MAX_ROWS
    x = torch.randn(rows, 32).to(dtype)
    out = layer.forward(x)
    assert bool(calls) is fused and out.shape == x.shape and out.dtype == dtype
    top_ids, top_weights = layer.router.forward(x)
    expected = grouped_experts(x, top_ids, top_weights, layer._expert, 4)
    torch.testing.assert_close(out, expected, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_shapes_that_do_not_fit_are_refused_before_the_kernel_reads():
    layer = _layer(16, 8, 4, 2, seed=0)
    x = torch.zeros(3, 16)
    router, w_in, w_out = layer.router.layer.weight, layer.input_linear.weight, layer.output_linear.weight
    with pytest.raises(ValueError, match="do not fit"):   # the gate | up rows of another intermediate size
        routed_moe_rows(x, router, 2, w_in[:, :12], w_out)
    with pytest.raises(ValueError, match="do not fit"):
        routed_moe_rows(torch.zeros(3, 8), router, 2, w_in, w_out)
    with pytest.raises(ValueError, match="do not fit"):   # a router of other experts
        routed_moe_rows(x, router[:3], 2, w_in, w_out)
    with pytest.raises(ValueError, match="do not fit"):
        routed_moe_rows(x, router, 5, w_in, w_out)
    with pytest.raises(ValueError, match="one dtype"):
        routed_moe_rows(x.to(torch.bfloat16), router, 2, w_in, w_out)
