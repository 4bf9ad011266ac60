"""GatedRMSNorm's spelled-out form against `F.rms_norm` over each group of `y * silu(gate)`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridpd.engine.model.layers.norms import GatedRMSNorm


@pytest.mark.parametrize(
    ("rows", "hidden", "groups", "dtype", "gate_strided"),
    [(1, 8, 1, torch.float32, False), (16, 256, 1, torch.float32, True), (4096, 256, 1, torch.float32, False),
     (5, 128, 2, torch.float32, True), (7, 64, 4, torch.float32, False), (3, 64, 2, torch.bfloat16, False),
     (9, 32, 1, torch.bfloat16, True)],
)
def test_gated_rms_norm_matches_reference(rows, hidden, groups, dtype, gate_strided):
    generator = torch.Generator().manual_seed(rows * hidden + groups)
    norm = GatedRMSNorm(hidden, hidden // groups, 1e-5, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=generator).to(dtype))
    y = torch.randn(rows, hidden, generator=generator) * 3  # float32, as the mixer passes it
    gate = (torch.randn(rows, hidden + 5, generator=generator) * 2).to(dtype)
    gate = gate[:, 5:] if gate_strided else gate[:, :hidden].contiguous()
    y_before, gate_before = y.clone(), gate.clone()
    with torch.inference_mode():
        out = norm(y, gate)
    h = (y * F.silu(gate.float())).view(rows, groups, hidden // groups)
    expected = norm.weight.float() * F.rms_norm(h, (hidden // groups,), eps=1e-5).view(rows, hidden)
    assert out.dtype == torch.float32 and out.shape == y.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(y, y_before) and torch.equal(gate, gate_before)
