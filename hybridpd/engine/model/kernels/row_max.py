"""The highest of a run of float32 elements, for compiled code (a numba intrinsic): LLVM's `maxnum` over sixteen
elements at a time in a vector, its lanes reduced once at the end, the last few one at a time.

numba's `max` in a loop is a chain LLVM keeps scalar, one element after the other: ~0.45 ns an element on the EPYC with
AVX-512 (benchmarks/README.md), where this reads them at the speed of their loads. Inputs are finite (NaN would be
skipped, as `maxnum` skips it). numba caches the kernels that use it beside their own sources and checks only those:
after editing this file, remove their `__pycache__/*.nb*` files.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

LANES = 16
_F32 = ir.FloatType()
_VECTOR = ir.VectorType(_F32, LANES)


@intrinsic
def highest(typingctx, row, lo, hi):  # pragma: no cover - compiled
    """The highest of row[lo:hi] (`row` a contiguous float32 vector, lo < hi within it)."""
    if not (isinstance(row, types.Array) and row.ndim == 1 and row.dtype == types.float32 and row.layout == "C"
            and isinstance(lo, types.Integer) and isinstance(hi, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        first, end = (context.cast(builder, a, t, types.intp) for a, t in zip(args[1:], signature.args[1:]))
        start = builder.gep(array.data, [first])
        count = builder.sub(end, first)
        blocks = builder.sdiv(count, ir.Constant(count.type, LANES))
        vector_max = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VECTOR, [_VECTOR, _VECTOR]),
                                                    "llvm.maxnum.v16f32")
        scalar_max = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32, _F32]),
                                                    "llvm.maxnum.f32")
        lanes_max = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_VECTOR]),
                                                   "llvm.vector.reduce.fmax.v16f32")
        running = cgutils.alloca_once_value(builder, ir.Constant(_VECTOR, [float("-inf")] * LANES))
        with cgutils.for_range(builder, blocks) as loop:
            at = builder.gep(start, [builder.mul(loop.index, ir.Constant(count.type, LANES))])
            values = builder.load(builder.bitcast(at, _VECTOR.as_pointer()), align=4)
            builder.store(builder.call(vector_max, [builder.load(running), values]), running)
        result = cgutils.alloca_once_value(builder, builder.call(lanes_max, [builder.load(running)]))
        done = builder.mul(blocks, ir.Constant(count.type, LANES))
        with cgutils.for_range(builder, builder.sub(count, done)) as loop:
            value = builder.load(builder.gep(start, [builder.add(done, loop.index)]))
            builder.store(builder.call(scalar_max, [builder.load(result), value]), result)
        return builder.load(result)

    return types.float32(row, lo, hi), codegen
