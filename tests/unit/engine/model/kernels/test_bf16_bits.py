"""bfloat16 inside compiled kernels: an element widened from its bits is its exact float32 value, and a float32
narrowed to bfloat16 bits rounds as torch rounds (to nearest, ties to even), over values that include exact ties,
subnormals and both signs; on float32 both are the identity. A kernel array kept on a tensor (`held_array`) is the
tensor's memory, made again when that memory or its shape changes, and keeps no cycle."""

from __future__ import annotations

import gc
import weakref

import numba
import numpy as np
import pytest
import torch

from hybridpd.engine.model.kernels.bf16_bits import held_array, kernel_array, narrow, widen


@numba.njit(cache=False)
def _widen_all(source, out):
    for i in range(source.shape[0]):
        out[i] = widen(source[i])


@numba.njit(cache=False)
def _narrow_all(source, out):
    for i in range(source.shape[0]):
        out[i] = narrow(source[i], out)


def _values() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    random = torch.randn(50_000, generator=gen) * torch.logspace(-40, 30, 50_000).float()
    grid = (torch.randn(1_000, generator=gen) * 100).to(torch.bfloat16)
    bits = grid.view(torch.int16).to(torch.int32) & 0xFFFF
    ties = ((bits << 16) | 0x8000).view(torch.float32)   # exactly halfway between a bfloat16 and the next: even and odd
    return torch.cat([random, -random, ties, torch.tensor([0.0, -0.0, 1e-40, -1e-40])])


def test_narrow_rounds_as_torch_does():
    values = _values()
    out = np.empty(values.shape[0], dtype=np.uint16)
    _narrow_all(values.numpy(), out)
    assert np.array_equal(out, values.to(torch.bfloat16).view(torch.uint16).numpy())


def test_widen_is_exact():
    bits = _values().to(torch.bfloat16)
    out = np.empty(bits.shape[0], dtype=np.float32)
    _widen_all(bits.view(torch.uint16).numpy(), out)
    assert np.array_equal(out, bits.float().numpy())


def test_both_are_the_identity_on_float32():
    values = _values().numpy()
    widened, narrowed = np.empty_like(values), np.empty_like(values)
    _widen_all(values, widened)
    _narrow_all(values, narrowed)
    assert np.array_equal(widened, values) and np.array_equal(narrowed, values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_a_held_array_is_the_tensors_memory_kept_until_it_changes(dtype):
    t = torch.zeros(3, 4, dtype=dtype)
    first = held_array(t)
    assert held_array(t) is first                          # kept
    assert np.array_equal(first, kernel_array(t))
    t[1, 2] = 5                                            # the same memory: writes show through
    assert np.array_equal(held_array(t), kernel_array(t))
    t.set_(torch.ones(3, 4, dtype=dtype))                  # other memory
    assert held_array(t) is not first and np.array_equal(held_array(t), kernel_array(t))
    t.resize_(2, 4)                                        # another shape over the same memory
    assert held_array(t).shape == (2, 4)
    assert held_array(t.t()).shape == (4, 2)               # a view is a tensor of its own


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_held_array_keeps_no_cycle(dtype):
    gc.disable()
    try:
        t = torch.zeros(8, dtype=dtype)
        held_array(t)
        gone = weakref.ref(t)
        del t
        assert gone() is None                              # freed by its reference count, not the collector
    finally:
        gc.enable()
