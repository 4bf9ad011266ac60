"""The compiled top-k gating against transformers' `GraniteMoeHybridTopKGating` spelled in torch (the product in the
activations' dtype, `topk` of its float32 values, a softmax over those k, cast back), the lower expert first among
equal logits, its refusals, and the router taking it for float32 and bfloat16 only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridpd.engine.model.kernels.fused_router import top_k_route
from hybridpd.engine.model.layers.moe import TopKRouter

BF16 = torch.bfloat16


def _reference(x: torch.Tensor, weight: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(x.float(), weight.float()).to(x.dtype).float()   # summed in float32, rounded once
    top_logits, top_ids = logits.topk(k, dim=-1)
    return top_ids, torch.softmax(top_logits, dim=-1).to(x.dtype).float()


def _inputs(rows: int, hidden: int, experts: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (torch.randn(experts, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    return x, weight


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("rows, hidden, experts, k", [
    (1, 16, 4, 1), (5, 32, 6, 2), (16, 128, 16, 4), (3, 40, 3, 3), (9, 64, 64, 6), (2, 24, 128, 8),
])
def test_agrees_with_transformers_gating(dtype, rows, hidden, experts, k):
    x, weight = _inputs(rows, hidden, experts, dtype, seed=rows * experts + k)
    ids, weights = top_k_route(x, weight, k)
    want_ids, want_weights = _reference(x, weight, k)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == weights.shape == (rows, k)
    logits = F.linear(x.float(), weight.float()).to(dtype).float()
    # The same experts in the same order, but where two logits are equal (then either order is the top-k).
    same = (ids == want_ids) | (logits.gather(1, ids) == logits.gather(1, want_ids))
    assert bool(same.all())
    tolerance = 2 ** -8 if dtype == BF16 else 1e-6
    torch.testing.assert_close(weights, want_weights, rtol=tolerance, atol=tolerance)
    assert bool((weights.to(dtype).float() == weights).all())   # values of the activations' dtype


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_the_lower_expert_comes_first_among_equal_logits(dtype):
    weight = torch.zeros(6, 4, dtype=dtype)
    weight[[1, 3, 4], 0] = 1.0   # experts 1, 3 and 4 tie at the top, 0, 2 and 5 at zero
    x = torch.tensor([[2.0, 0, 0, 0]], dtype=dtype)
    ids, weights = top_k_route(x, weight, 4)
    assert ids.tolist() == [[1, 3, 4, 0]]
    e = torch.exp(torch.tensor(-2.0))
    torch.testing.assert_close(weights, (torch.tensor([[1, 1, 1, e]]) / (3 + e)).to(dtype).float())


@pytest.mark.parametrize("x, weight, k, match", [
    (torch.zeros(2, 8), torch.zeros(4, 8, dtype=BF16), 2, "one dtype"),
    (torch.zeros(2, 8, dtype=torch.float64), torch.zeros(4, 8, dtype=torch.float64), 2, "one dtype"),
    (torch.zeros(2, 8), torch.zeros(4, 6), 2, "contiguous"),
    (torch.zeros(2, 8), torch.zeros(4, 8), 5, "contiguous"),
    (torch.zeros(2, 8), torch.zeros(4, 8), 0, "contiguous"),
    (torch.zeros(8, 2).t(), torch.zeros(4, 8), 2, "contiguous"),
])
def test_refuses_what_it_cannot_read(x, weight, k, match):
    with pytest.raises(ValueError, match=match):
        top_k_route(x, weight, k)


def test_the_router_takes_torch_for_other_dtypes():
    router = TopKRouter(16, 4, 2, torch.float64)
    with torch.no_grad():
        router.layer.weight.copy_(torch.randn(4, 16, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ids, weights = router.forward(x)
    want_ids, want_weights = _reference(x, router.layer.weight, 2)
    assert torch.equal(ids, want_ids) and weights.dtype == torch.float32
    torch.testing.assert_close(weights, want_weights)
