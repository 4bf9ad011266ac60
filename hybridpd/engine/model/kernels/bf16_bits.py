"""bfloat16 inside the compiled kernels, which numba and numpy do not know: a bfloat16 tensor is handed over as its
uint16 bits (`tensor.view(torch.uint16)`), an element is widened to float32 where it is read (`widen`: its bits are
the high half of a float32's) and a float32 result is narrowed where it is stored (`narrow`: rounded to nearest,
ties to even, as torch rounds). Both are the identity on float32, so one kernel source compiles for either dtype:
its arithmetic is float32 throughout, and a bfloat16 value is rounded once, when it is stored.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload


# What the compiled kernels take: float32, and bfloat16 handed over as its bits (computed in float32).
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


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
