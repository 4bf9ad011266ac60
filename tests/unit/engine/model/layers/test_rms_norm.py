"""RMSNorm against torch's own `F.rms_norm` (float32) and transformers' formula (bfloat16: rounded at the same points,
so equal but where the float32 sums, run in another order, put a value on the other side of a rounding boundary)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridpd.engine.model.layers.norms import RMSNorm


@pytest.mark.parametrize(
    ("rows", "hidden", "dtype"),
    [(1, 8, torch.float32), (16, 128, torch.float32), (4096, 128, torch.float32), (3, 64, torch.bfloat16),
     (257, 128, torch.bfloat16)],
)
def test_rms_norm_matches_reference(rows: int, hidden: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(rows * hidden)
    norm = RMSNorm(hidden, 1e-5, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=generator).to(dtype))
    x = (torch.randn(rows, hidden, generator=generator) * 3).to(dtype)
    with torch.inference_mode():
        out = norm(x)
    if dtype == torch.float32:
        expected = F.rms_norm(x, (hidden,), norm.weight, 1e-5)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    else:  # transformers: normalise in float32, apply the weight in the input's dtype
        h = x.float()
        expected = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -7, atol=1e-5)   # one bfloat16 step
        assert (out != expected).float().mean() < 1e-3   # measured: 3 of 32,896 values at 257 rows
    assert out.dtype == dtype and out.shape == x.shape


def test_rms_norm_leaves_its_input_alone() -> None:
    x = torch.randn(4, 16)
    before = x.clone()
    RMSNorm(16, 1e-5, torch.float32)(x)
    assert torch.equal(x, before)
