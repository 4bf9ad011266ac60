"""The compiled RMSNorm and residual-add-then-RMSNorm against torch's `F.rms_norm` on float32 rows, and the
module's choice: float32 or bfloat16 contiguous rows take the kernel, anything else the spelled-out torch form, with
the same results (in bfloat16 to one bfloat16 step: the kernel rounds where the torch form does)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridpd.engine.model.kernels.fused_norm import residual_rms_norm, rms_norm
from hybridpd.engine.model.layers import norms
from hybridpd.engine.model.layers.norms import RMSNorm


@pytest.mark.parametrize(("rows", "width", "scale"), [(1, 8, 1.0), (16, 128, 3.0), (4096, 128, 0.01), (5, 100, 50.0)])
def test_kernels_match_torch(rows, width, scale):
    gen = torch.Generator().manual_seed(rows + width)
    h = torch.randn(rows, width, generator=gen) * scale
    delta = torch.randn(rows, width, generator=gen) * scale
    weight = torch.randn(width, generator=gen)
    before = h.clone(), delta.clone()

    torch.testing.assert_close(rms_norm(h, weight, 1e-5), F.rms_norm(h, (width,), weight, 1e-5), rtol=1e-5, atol=1e-6)
    summed, normed = residual_rms_norm(h, delta, 0.5, weight, 1e-5)
    want = h + 0.5 * delta
    torch.testing.assert_close(summed, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(normed, F.rms_norm(want, (width,), weight, 1e-5), rtol=1e-5, atol=1e-6)
    assert torch.equal(h, before[0]) and torch.equal(delta, before[1])  # inputs untouched


@pytest.mark.parametrize("case", ["float32", "strided", "bfloat16", "float64"])
def test_module_takes_the_kernel_only_where_it_applies(case, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    dtype = {"bfloat16": torch.bfloat16, "float64": torch.float64}.get(case, torch.float32)
    norm = RMSNorm(64, 1e-5, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen).to(dtype))
    wide = torch.randn(6, 80, generator=gen).to(dtype)
    h = wide[:, :64] if case == "strided" else wide[:, :64].contiguous()
    delta = torch.randn(6, 64, generator=gen).to(dtype)
    calls = []
    for name in ("rms_norm", "residual_rms_norm"):
        real = getattr(norms, name)
        monkeypatch.setattr(norms, name, lambda *a, real=real: calls.append(real) or real(*a))
    with torch.inference_mode():
        got = norm(h), *norm.add_and_norm(h, delta, 0.5)
        monkeypatch.setattr(norms, "_fusable", lambda x, w: False)
        want = norm(h), *norm.add_and_norm(h, delta, 0.5)
    # strided rows: the add runs in torch, whose (contiguous) sum the norm then takes through the kernel
    assert len(calls) == {"float32": 2, "strided": 1, "bfloat16": 2, "float64": 0}[case]
    tolerance = {"rtol": 2 ** -7, "atol": 1e-5} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == dtype
        torch.testing.assert_close(a, b, **tolerance)
