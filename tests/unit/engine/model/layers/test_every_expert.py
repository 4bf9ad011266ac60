"""Every expert at once (layers/moe.py's `every_expert`) agrees with the grouped dispatch, and a layer takes that path
only for bfloat16 steps of enough rows on packed products on AMX and only when its experts stay in cache."""

from __future__ import annotations

import pytest
import torch

from hybridpd.engine.model.kernels.fused_moe import RESIDENT_BYTES
from hybridpd.engine.model.layers import moe as moe_module
from hybridpd.engine.model.layers.moe import EVERY_EXPERT_MIN_ROWS, GraniteMoE, every_expert, grouped_experts


def _layer(hidden: int, inter: int, experts: int, top_k: int, seed: int, dtype: torch.dtype) -> GraniteMoE:
    layer = GraniteMoE(hidden, inter, experts, top_k, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return layer.to(dtype)


def _expected(layer: GraniteMoE, x: torch.Tensor) -> torch.Tensor:
    top_ids, top_weights = layer.router.forward(x)
    return grouped_experts(x, top_ids, top_weights, layer._expert, layer.num_experts)


@pytest.mark.parametrize("rows, hidden, inter, experts, top_k", [
    (1, 16, 8, 4, 1), (5, 32, 24, 6, 2), (40, 128, 64, 16, 4), (3, 40, 12, 3, 3), (64, 24, 16, 8, 8),
])
def test_agrees_with_the_grouped_dispatch_in_float32(rows, hidden, inter, experts, top_k):
    layer = _layer(hidden, inter, experts, top_k, seed=rows + hidden, dtype=torch.float32)
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows))
    top_ids, top_weights = layer.router.forward(x)
    got = every_expert(x, top_ids, top_weights, layer.input_linear.weight, layer._w_out_side_by_side())
    torch.testing.assert_close(got, _expected(layer, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [EVERY_EXPERT_MIN_ROWS, 100])
def test_agrees_with_float32_to_bfloat16_rounding(rows):
    layer = _layer(128, 64, 16, 4, seed=rows, dtype=torch.bfloat16)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    top_ids, top_weights = layer.router.forward(x)
    got = every_expert(x, top_ids, top_weights, layer.input_linear.weight, layer._w_out_side_by_side())
    wide = _layer(128, 64, 16, 4, seed=rows, dtype=torch.bfloat16).float()
    expected = grouped_experts(x.float(), top_ids, top_weights.float(), wide._expert, 16)
    assert got.dtype == torch.bfloat16
    # bfloat16 rounding of the gate | up products, the activations and the result: a few of its steps
    torch.testing.assert_close(got.float(), expected, rtol=2 ** -5, atol=2 ** -7)


@pytest.mark.parametrize("rows, dtype, packs, experts, every", [
    (EVERY_EXPERT_MIN_ROWS, torch.bfloat16, True, 16, True),
    (300, torch.bfloat16, True, 16, True),                  # past the compiled kernel's rows too
    (EVERY_EXPERT_MIN_ROWS - 1, torch.bfloat16, True, 16, False),   # a decode step: the compiled kernel
    (EVERY_EXPERT_MIN_ROWS, torch.bfloat16, False, 16, False),  # no AMX: the compiled kernel or the grouped dispatch
    (EVERY_EXPERT_MIN_ROWS, torch.float32, True, 16, False),
    (EVERY_EXPERT_MIN_ROWS, torch.bfloat16, True, 1024, False),  # 1,024 experts: past RESIDENT_BYTES
])
def test_the_layer_takes_every_expert_only_where_it_pays(monkeypatch, rows, dtype, packs, experts, every):
    for cpu_has in ("packs_products", "products_on_tiles"):
        monkeypatch.setattr(moe_module, cpu_has, lambda d: packs and d == torch.bfloat16)
    calls = []
    monkeypatch.setattr(moe_module, "every_expert", lambda *a: calls.append(1) or every_expert(*a))
    assert (3 * 32 * 16 * 1024 * 2 > RESIDENT_BYTES) and (3 * 32 * 16 * 16 * 2 <= RESIDENT_BYTES)
    layer = _layer(32, 16, experts, 2, seed=rows, dtype=dtype)
    x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = layer.forward(x)
    assert bool(calls) is every and out.shape == x.shape and out.dtype == dtype
    tolerance = 2 ** -5 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), _expected(layer, x).float(), rtol=tolerance, atol=tolerance)


def test_a_reloaded_down_projection_is_taken_again(monkeypatch):
    for cpu_has in ("packs_products", "products_on_tiles"):
        monkeypatch.setattr(moe_module, cpu_has, lambda d: True)
    calls = []
    monkeypatch.setattr(moe_module, "every_expert", lambda *a: calls.append(1) or every_expert(*a))
    layer = _layer(32, 16, 8, 2, seed=3, dtype=torch.bfloat16)
    x = torch.randn(EVERY_EXPERT_MIN_ROWS, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.inference_mode():
        first = layer.forward(x)
    close = {"rtol": 2 ** -5, "atol": 2 ** -5}
    torch.testing.assert_close(first.float(), _expected(layer, x).float(), **close)
    with torch.no_grad():   # a checkpoint loaded into the same parameter, in place
        layer.output_linear.weight.mul_(-2.0)
    with torch.inference_mode():
        second = layer.forward(x)
    assert len(calls) == 2
    torch.testing.assert_close(second.float(), _expected(layer, x).float(), **close)
    torch.testing.assert_close(second.float(), -2.0 * first.float(), **close)
