"""bfloat16 inside the compiled kernels, which numba and numpy do not know: a bfloat16 tensor is handed over as its
uint16 bits (`tensor.view(torch.uint16)`), an element is widened to float32 where it is read (`widen`: its bits are
the high half of a float32's) and a float32 result is narrowed where it is stored (`narrow`: rounded to nearest,
ties to even, as torch rounds). Both are the identity on float32, so one kernel source compiles for either dtype:
its arithmetic is float32 throughout, and a bfloat16 value is rounded once, when it is stored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload


# What the compiled kernels take: float32, and bfloat16 handed over as its bits (computed in float32).
KERNEL_DTYPES = (torch.float32, torch.bfloat16)

T = TypeVar("T")


def kernel_view(t: torch.Tensor) -> torch.Tensor:
    """`t` as the kernels take it: a bfloat16 tensor as its bits (uint16: the same memory and strides), else as is
    (detached only where it requires grad: a decode step makes ~1,000 of these calls, and a detach costs as much
    as the view)."""
    if t.requires_grad:
        t = t.detach()
    return t.view(torch.uint16) if t.dtype == torch.bfloat16 else t


def kernel_array(t: torch.Tensor) -> np.ndarray:
    """The numpy array of `kernel_view(t)` (the same memory)."""
    return kernel_view(t).numpy()


def held(t: torch.Tensor, attribute: str, make: Callable[[torch.Tensor], T]) -> T:
    """`make(t)` for a tensor that outlives the call (a cache view, a buffer, a weight, a step's metadata that every
    layer reads): made once and kept on the tensor under `attribute`, made again when the tensor's memory, shape or
    strides changed. What `make` returns must not refer to `t` itself (a view of its memory is fine): else the two
    would make a cycle, freed only by the garbage collector."""
    kept = getattr(t, attribute, None)
    key = (t.data_ptr(), t.shape, t.stride())
    if kept is None or kept[0] != key:
        kept = (key, make(t))
        setattr(t, attribute, kept)
    return kept[1]


def held_array(t: torch.Tensor) -> np.ndarray:
    """`kernel_array(t)` kept on a tensor that outlives the call (`held`): ~0.35 us a call where a bfloat16 tensor's
    view and array cost ~1.2 (a decode step makes a few hundred such calls). The array's base is a detached alias
    or a view of the tensor, not the tensor (torch's `numpy()`)."""
    return held(t, "_hybridpd_kernel_array", kernel_array)


@intrinsic
def float_from_bits(typingctx, bits):  # pragma: no cover - compiled
    """The float32 whose bits are the uint32 `bits` (compiled code only)."""
    if bits != types.uint32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _bits_of_float(typingctx, value):  # pragma: no cover - compiled
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


def widen(element):  # pragma: no cover - replaced by the overload in compiled code
    """A stored element as float32: bfloat16 bits (uint16) widened exactly, a float32 as it is."""
    raise NotImplementedError("compiled code only")


def narrow(value, like):  # pragma: no cover - replaced by the overload in compiled code
    """A float32 value as an element of the array `like`: bfloat16 bits rounded to nearest even, or the float32."""
    raise NotImplementedError("compiled code only")


@overload(widen, inline="always")
def _widen(element):  # pragma: no cover - compiled
    if element == types.uint16:
        return lambda element: float_from_bits(np.uint32(np.uint32(element) << np.uint32(16)))
    if element == types.float32:
        return lambda element: element
    return None


@overload(narrow, inline="always")
def _narrow(value, like):  # pragma: no cover - compiled
    if like.dtype == types.uint16:
        def to_bits(value, like):
            bits = _bits_of_float(np.float32(value))
            rounding = np.uint32(np.uint32(0x7FFF) + np.uint32(np.uint32(bits >> np.uint32(16)) & np.uint32(1)))
            return np.uint16(np.uint32(bits + rounding) >> np.uint32(16))
        return to_bits
    if like.dtype == types.float32:
        return lambda value, like: np.float32(value)
    return None
