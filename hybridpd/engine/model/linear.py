"""`linear(x, weight, bias)`: `F.linear` with the GEMM library chosen by the number of rows.

torch's CPU `F.linear` calls MKL's sgemm. For the few rows of a decode step that is the faster library; for the
thousands of rows of a prefill, oneDNN's kernel (the one torch's own compiler emits for CPU linears) runs at
~100 GFLOP/s on one AVX-512 core against MKL's ~80 (measured here on [4096, 128] x [128, 512] and [4096, 256] x
[256, 128]). The two agree to float32 rounding (a different summation order). oneDNN is used only where torch
has it and only for float32, and needs no packed copy of the weight, so a reloaded weight can never go stale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows from which oneDNN is the faster library (crossover measured between 128 and 512 rows).
ONEDNN_MIN_ROWS = 512


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


ONEDNN = _onednn_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a 2-D `x`."""
    if ONEDNN and x.shape[0] >= ONEDNN_MIN_ROWS and x.dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
