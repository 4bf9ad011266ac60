"""One check both projection paths' tests share: a product agrees with `F.linear` on a random case."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def check_agrees_with_f_linear(product: Callable[..., torch.Tensor], rows: int, inputs: int, outputs: int,
                               with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + inputs + outputs)
    x = torch.randn(rows, inputs, generator=gen)
    weight = torch.randn(outputs, inputs, generator=gen) / inputs ** 0.5
    bias = torch.randn(outputs, generator=gen) if with_bias else None
    got = product(x, weight, bias)
    assert got.shape == (rows, outputs) and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
