"""The vector code of the decode attention (decode_attention.py) for one block of keys, written as LLVM IR inside the
compiled kernel (numba intrinsics): a block is `lanes` keys in a row (16 where the CPU has AVX-512, else 8), one KV
head, every query head that shares it.

- `block_scores`: each query head's scores over the block's keys, and its running maximum lane by lane. A key's
  products with the query are summed chunk by chunk into one vector of `lanes` partial sums; the block's `lanes`
  vectors are then summed across their lanes together, as a tree of shuffles and adds (log2(lanes) levels, each
  halving the lanes a key holds). LLVM, given the sums one key at a time, reduces each vector on its own: ~9
  dependent instructions a key and query head, most of the kernel's time (benchmarks/README.md).
- `block_values`: each query head's accumulator plus the block's values, each weighted by its key's weight.

Head size and group (query heads per KV head) are compile-time literals: the IR holds the loops over them unrolled,
each key element is loaded and widened once for every query head. bfloat16 comes as its bits (bf16_bits.py) and is
widened in registers; a head size that is not a multiple of `lanes` ends in a shorter chunk (zeros in the scores'
spare lanes). Arithmetic is float32 throughout.

numba caches the kernels that use these beside their own sources and checks only those: after editing this file,
remove `__pycache__/decode_attention*.nb*` (a fresh clone has none).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_BYTES = ir.IntType(8).as_pointer()
_FAST = ("fast",)


def _vector(lanes: int) -> ir.VectorType:
    return ir.VectorType(_F32, lanes)


def _mask(indices: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, len(indices)), indices)


def _address(builder, base, byte_offset, to: ir.Type):
    """`base` + `byte_offset` bytes as a pointer to `to`."""
    return builder.bitcast(builder.gep(builder.bitcast(base, _BYTES), [byte_offset]), to.as_pointer())


def _chunks(dim: int, lanes: int) -> list[tuple[int, int]]:
    """(first element, width) of each chunk of a head: full vectors, then what is left."""
    return [(c, min(lanes, dim - c)) for c in range(0, dim, lanes)]


def _load_floats(builder, base, byte_offset, width: int, bits: bool):
    """`width` elements at `base` + `byte_offset` as float32: bfloat16 bits widened (they are a float32's high
    half), float32 as they are."""
    if not bits:
        return builder.load(_address(builder, base, byte_offset, _vector(width)), align=4)
    raw = builder.load(_address(builder, base, byte_offset, ir.VectorType(ir.IntType(16), width)), align=2)
    wide = builder.zext(raw, ir.VectorType(_I32, width))
    return builder.bitcast(builder.shl(wide, ir.Constant(ir.VectorType(_I32, width), [16] * width)), _vector(width))


def _block_row(builder, data, start, t: int, dim: int, chunks: list[tuple[int, int]], bits: bool) -> list:
    """Row `start + t` of the C-contiguous [n, dim] array at `data`, chunk by chunk, as float32 vectors."""
    size = 2 if bits else 4
    row = builder.mul(builder.add(start, ir.Constant(_I64, t)), ir.Constant(_I64, dim * size))
    return [_load_floats(builder, data, builder.add(row, ir.Constant(_I64, c * size)), w, bits) for c, w in chunks]


def _to_lanes(builder, v, width: int, lanes: int):
    """A vector of `width` <= `lanes` floats as `lanes` of them, zeros after."""
    if width == lanes:
        return v
    zeros = ir.Constant(_vector(width), None)
    return builder.shuffle_vector(v, zeros, _mask([i if i < width else width for i in range(lanes)]))


def _pair_sums(builder, x, y, width: int, lanes: int):
    """x and y hold keys' partial sums, `width` lanes a key: the result holds x's keys then y's, `width / 2` lanes a
    key, each the sum of two of its lanes before."""
    half = width // 2
    low, high = [], []
    for offset in (0, lanes):
        for group in range(0, lanes, width):
            low += [offset + group + i for i in range(half)]
            high += [offset + group + half + i for i in range(half)]
    return builder.fadd(builder.shuffle_vector(x, y, _mask(low)), builder.shuffle_vector(x, y, _mask(high)),
                        flags=_FAST)


def _lane_sums(builder, rows: list, lanes: int):
    """`lanes` vectors of `lanes` floats -> one vector whose lane t is the sum of vector t's lanes."""
    width = lanes
    while len(rows) > 1:
        rows = [_pair_sums(builder, rows[i], rows[i + 1], width, lanes) for i in range(0, len(rows), 2)]
        width //= 2
    return rows[0]


def _row_bytes(builder, array, row):
    """The byte offset of `row` of a C-contiguous 2-D array struct."""
    return builder.mul(row, cgutils.unpack_tuple(builder, array.strides, 2)[0])


def _block_shape(dim, group, lanes) -> tuple[int, int, int, list[tuple[int, int]]] | None:
    """Head size, group, lanes and the head's chunks from the literal types the kernel passes, or None (typing
    then fails: these intrinsics unroll over them)."""
    if not all(isinstance(v, types.IntegerLiteral) for v in (dim, group, lanes)):
        return None
    dim_, group_, lanes_ = dim.literal_value, group.literal_value, lanes.literal_value
    return dim_, group_, lanes_, _chunks(dim_, lanes_)


@intrinsic(prefer_literal=True)
def block_scores(typingctx, keys, start, q, scores, col, top, dim, group, lanes):  # pragma: no cover - compiled
    """Keys `start` .. `start + lanes - 1` of `keys` [n, dim] (float32, or bfloat16 as uint16 bits; C-contiguous,
    all of them within n): scores[h, col + t] = q[h] . key t for each query head h of `q` [group, dim] (float32, the
    scale applied), and top[h] [lanes] = their maximum with what it held, lane by lane."""
    shape = _block_shape(dim, group, lanes)
    if shape is None:
        return None
    dim_, group_, lanes_, chunks = shape

    def codegen(context, builder, signature, args):
        key_type, _, q_type, score_type, _, top_type = signature.args[:6]
        bits = key_type.dtype == types.uint16
        key_arr, q_arr, score_arr, top_arr = (context.make_array(t)(context, builder, a) for t, a in
                                              ((key_type, args[0]), (q_type, args[2]), (score_type, args[3]),
                                               (top_type, args[5])))
        queries = [[_load_floats(builder, q_arr.data, ir.Constant(_I64, (h * dim_ + c) * 4), w, False)
                    for c, w in chunks] for h in range(group_)]
        partial: list[list] = [[] for _ in range(group_)]
        for t in range(lanes_):
            key = _block_row(builder, key_arr.data, args[1], t, dim_, chunks, bits)
            for h in range(group_):
                total = None
                for (_, w), qc, kc in zip(chunks, queries[h], key):
                    term = _to_lanes(builder, builder.fmul(qc, kc, flags=_FAST), w, lanes_)
                    total = term if total is None else builder.fadd(total, term, flags=_FAST)
                partial[h].append(total)
        vector = _vector(lanes_)
        maxnum = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector, vector]),
                                                f"llvm.maxnum.v{lanes_}f32")
        column = builder.mul(args[4], ir.Constant(_I64, 4))
        for h in range(group_):
            sums = _lane_sums(builder, partial[h], lanes_)
            head = ir.Constant(_I64, h)
            at = _address(builder, score_arr.data, builder.add(_row_bytes(builder, score_arr, head), column), vector)
            builder.store(sums, at, align=4)
            high = _address(builder, top_arr.data, _row_bytes(builder, top_arr, head), vector)
            builder.store(builder.call(maxnum, [builder.load(high, align=4), sums]), high, align=4)
        return context.get_dummy_value()

    return types.void(keys, start, q, scores, col, top, dim, group, lanes), codegen


@intrinsic(prefer_literal=True)
def block_values(typingctx, values, start, weights, col, acc, dim, group, lanes):  # pragma: no cover - compiled
    """acc[h] += Σ_t weights[h, col + t] * values[start + t] over the block's `lanes` keys, for each query head h
    (`values` [n, dim] float32 or bfloat16 bits, C-contiguous; `weights` [group, >= col + lanes] and `acc`
    [group, dim] float32)."""
    shape = _block_shape(dim, group, lanes)
    if shape is None:
        return None
    dim_, group_, lanes_, chunks = shape

    def codegen(context, builder, signature, args):
        value_type, _, weight_type, _, acc_type = signature.args[:5]
        bits = value_type.dtype == types.uint16
        value_arr, weight_arr, acc_arr = (context.make_array(t)(context, builder, a) for t, a in
                                          ((value_type, args[0]), (weight_type, args[2]), (acc_type, args[4])))
        slots = [[_address(builder, acc_arr.data, ir.Constant(_I64, (h * dim_ + c) * 4), _vector(w))
                  for c, w in chunks] for h in range(group_)]
        sums = [[builder.load(slot, align=4) for slot in row] for row in slots]
        column = builder.mul(args[3], ir.Constant(_I64, 4))
        weight_rows = [builder.load(_address(builder, weight_arr.data, builder.add(
            _row_bytes(builder, weight_arr, ir.Constant(_I64, h)), column), _vector(lanes_)), align=4)
            for h in range(group_)]
        for t in range(lanes_):
            value = _block_row(builder, value_arr.data, args[1], t, dim_, chunks, bits)
            for h in range(group_):
                for i, ((_, w), vc) in enumerate(zip(chunks, value)):
                    weight = builder.shuffle_vector(weight_rows[h], weight_rows[h], _mask([t] * w))
                    sums[h][i] = builder.fadd(sums[h][i], builder.fmul(weight, vc, flags=_FAST), flags=_FAST)
        for slot_row, sum_row in zip(slots, sums):
            for slot, total in zip(slot_row, sum_row):
                builder.store(total, slot, align=4)
        return context.get_dummy_value()

    return types.void(values, start, weights, col, acc, dim, group, lanes), codegen


@intrinsic
def prefetch_rows(typingctx, rows, start, count):  # pragma: no cover - compiled
    """A hint to the CPU to bring rows `start` .. `start + count - 1` of the C-contiguous 2-D array `rows` into its
    caches (a prefetch for every 64 bytes; a prefetch never faults, so rows past the array's end cost nothing but
    the hint). Emitted unrolled: `count` must be a literal."""
    if not isinstance(count, types.IntegerLiteral):
        return None
    lines = count.literal_value

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        row_bytes = cgutils.unpack_tuple(builder, array.strides, 2)[0]
        first = builder.mul(context.cast(builder, args[1], signature.args[1], types.intp), row_bytes)
        total = builder.mul(row_bytes, ir.Constant(row_bytes.type, lines))
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [_BYTES, _I32, _I32, _I32]), "llvm.prefetch.p0")
        base = builder.gep(builder.bitcast(array.data, _BYTES), [first])
        zero, line = ir.Constant(total.type, 0), ir.Constant(total.type, 64)
        with cgutils.for_range_slice(builder, zero, total, line) as (at, _):
            builder.call(prefetch, [builder.gep(base, [at]), ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                                    ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.void(rows, start, count), codegen
