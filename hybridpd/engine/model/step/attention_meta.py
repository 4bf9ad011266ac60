"""Attention metadata of one step for one KV group: where the new rows' K/V go, and which keys every query reads.

A sequence with one new token is a *decode* row: attention over all decode rows of a group is one batched gather +
attention (or reads DecodeKV's contiguous buffers). Prefill chunks read earlier keys block by block; sequences with
nothing computed before read their own new rows (fresh runs, batched by length, in query chunks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hybridpd.engine.kv_cache.spec import AttentionSpec, SlidingWindowSpec, dtype_size
from hybridpd.engine.model.step.decode_kv import DecodeKV, DecodeKVPlan
from hybridpd.engine.model.step.forward_batch import ForwardBatch, SeqEntry, int64_tensor
from hybridpd.engine.model.step.masks import additive, visible


@dataclass(frozen=True)
class AttentionDecode:
    """Decode rows read whole blocks: `blocks` [Sd * nb], row s's blocks at [s * nb, (s + 1) * nb) (key l of row
    s is token l % block_size of block l // block_size); `bias[s, 0, 0, l]` is 0 where key l counts for row s and
    -inf where it does not (an additive attention mask in the cache's dtype)."""

    rows: torch.Tensor
    blocks: torch.Tensor
    bias: torch.Tensor


@dataclass(frozen=True)
class AttentionPrefill:
    """One sequence's rows [row_start, row_start + num_rows) reading whole blocks `blocks` [nb], `keys` = nb *
    block_size keys; `bias` [n, keys] is 0 where a key is visible and -inf where not (an additive mask in the
    cache's dtype, built at the first layer that asks and shared by the group's others: given a bool mask, every
    layer's attention call would convert it; a step whose layers take oneDNN's products never builds it)."""

    row_start: int
    num_rows: int
    blocks: torch.Tensor
    keys: int
    first: int   # the key (index into the blocks read) of the first row's own position
    window: int | None
    dtype: torch.dtype

    @functools.cached_property
    def bias(self) -> torch.Tensor:
        rows = torch.arange(self.first, self.first + self.num_rows)
        return additive(visible(rows, torch.arange(self.keys), self.window), self.dtype)


@dataclass(frozen=True)
class QueryChunk:
    """Queries [q_start, q_end) of every sequence of a fresh run attend to keys [k_start, q_end): `bias`
    [q_end - q_start, q_end - k_start] is 0 where a key is visible and -inf where not (an additive mask in the
    cache's dtype, converted once here rather than by every layer's attention call), or None for causal with
    q_start == k_start == 0 (`is_causal`)."""

    q_start: int
    q_end: int
    k_start: int
    bias: torch.Tensor | None


@dataclass(frozen=True)
class FreshPrefillRun:
    """`num_seqs` consecutive sequences with nothing computed yet and `num_rows` new rows each, rows
    [row_start, row_start + num_seqs * num_rows): their keys are exactly their own new rows, so attention reads
    this step's K/V directly (no cache read), one batched call per query chunk (see `_query_chunks`; made at the
    first layer that asks and shared by the group's others)."""

    row_start: int
    num_seqs: int
    num_rows: int
    window: int | None
    dtype: torch.dtype

    @functools.cached_property
    def chunks(self) -> tuple[QueryChunk, ...]:
        return _query_chunks(self.num_rows, self.window, self.dtype)


@dataclass(frozen=True)
class AttentionGroupMeta:
    write_blocks: torch.Tensor   # [T] where each new row's K/V goes
    write_offsets: torch.Tensor  # [T]
    # The decode rows' gather from the paged cache: all of them (rows of the step), or with `decode_kv` only the
    # buffer rows it fills (rows of the buffers), or None when the buffers hold every row's keys.
    decode: AttentionDecode | None
    prefills: tuple[AttentionPrefill, ...]  # sequences that read earlier keys from the cache
    fresh: tuple[FreshPrefillRun, ...] = ()
    decode_kv: DecodeKVPlan | None = None  # the decode rows served from DecodeKV buffers
    decode_rows: torch.Tensor | None = None  # with `decode_kv` in a step with prefill rows: the decode rows of T


def attention_group_meta(
    batch: ForwardBatch, group_id: int, spec: AttentionSpec, shared: dict[tuple, DecodeLayout] | None = None,
    decode_kv: DecodeKV | None = None,
) -> AttentionGroupMeta:
    """With `decode_kv`, the decode rows read contiguous buffers (decode_kv.py); `shared` holds the decode layouts
    groups with equal block sizes, windows and dtypes share within a step."""
    window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
    token_bytes = spec.num_kv_heads * spec.head_size * dtype_size(spec.dtype)

    def plan_for(seqs: Sequence[SeqEntry]) -> DecodeKVPlan | None:
        if decode_kv is None or not seqs:
            return None
        return decode_kv.plan(group_id, [s.key for s in seqs], [s.num_computed for s in seqs], token_bytes,
                              spec.dtype, window)

    if not batch.all_decode:
        return _attention_meta(batch, group_id, spec.block_size, window, spec.dtype, plan_for)
    layouts = {} if shared is None else shared
    return _decode_only_meta(batch, group_id, spec.block_size, window, spec.dtype, layouts, plan_for(batch.seqs))


def _attention_meta(
    batch: ForwardBatch, g: int, block_size: int, window: int | None, dtype: torch.dtype,
    plan_for: Callable[[Sequence[SeqEntry]], DecodeKVPlan | None] = lambda seqs: None,
) -> AttentionGroupMeta:
    write_blocks: list[int] = []
    decode_rows: list[int] = []
    decode_seqs: list[SeqEntry] = []
    prefills = []
    fresh: list[list[int]] = []  # [row_start, num_seqs, num_rows] runs
    for row_start, s in zip(batch.row_starts, batch.seqs):
        table = s.block_tables[g]
        if s.num_new == 1:
            write_blocks.append(table[s.num_computed // block_size])
            decode_rows.append(row_start)
            decode_seqs.append(s)
            continue
        for logical in range(s.num_computed // block_size, (s.end - 1) // block_size + 1):
            rows_in_block = min(s.end, (logical + 1) * block_size) - max(s.num_computed, logical * block_size)
            write_blocks.extend([table[logical]] * rows_in_block)
        if s.num_computed > 0:
            prefills.append(_attention_prefill(row_start, s, table, block_size, window, dtype))
        elif fresh and fresh[-1][2] == s.num_new and fresh[-1][0] + fresh[-1][1] * s.num_new == row_start:
            fresh[-1][1] += 1
        else:
            fresh.append([row_start, 1, s.num_new])
    decode = None
    plan = plan_for(decode_seqs)
    if plan is not None:
        decode = _fill_gather(plan, decode_seqs, g, block_size, dtype)
    elif decode_rows:
        decode = _attention_decode(decode_rows, decode_seqs, g, block_size, window, dtype)
    return AttentionGroupMeta(
        write_blocks=int64_tensor(write_blocks), write_offsets=batch.positions % block_size,
        decode=decode, prefills=tuple(prefills), decode_kv=plan,
        decode_rows=None if plan is None else int64_tensor(decode_rows),
        fresh=tuple(
            FreshPrefillRun(row_start=r, num_seqs=k, num_rows=n, window=window, dtype=dtype)
            for r, k, n in fresh
        ),
    )


# Query rows per chunk of a fresh run (see `_query_chunks`); 32 was fastest for runs of 256 rows, windows 64/160.
QUERY_CHUNK = 32
# torch's CPU flash kernel skips key blocks above the diagonal under `is_causal` only at its own key-block size
# (512 keys): shorter causal runs gain from chunking, longer ones do not. A run of exactly 512 rows gains too (one
# key block, nothing skipped: a 512-token prefill 0.88 of the time in bfloat16, 0.96 in float32); 768 and 1,024
# rows were even (benchmarks/README.md).
CAUSAL_CHUNK_BELOW = 768


def _query_chunks(n: int, window: int | None, dtype: torch.dtype) -> tuple[QueryChunk, ...]:
    """How a fresh run of n rows attends: query chunks that read only the keys some query of the chunk sees.

    Why: torch's CPU flash kernel computes every (query, key) score of a call, masked or not, apart from the
    causal skipping described at CAUSAL_CHUNK_BELOW. A window of W rows sees `chunk + W - 1` keys per chunk
    instead of n; a causal chunk ending at row e sees e keys instead of n (half the work overall). The masks
    depend only on n and the window, so they are built once per step and shared by the group's layers.
    """
    if window is None and n >= CAUSAL_CHUNK_BELOW:
        return (QueryChunk(q_start=0, q_end=n, k_start=0, bias=None),)
    chunks = []
    for q_start in range(0, n, QUERY_CHUNK):
        q_end = min(n, q_start + QUERY_CHUNK)
        if window is None and q_start == 0:
            chunks.append(QueryChunk(q_start=0, q_end=q_end, k_start=0, bias=None))
            continue
        k_start = _first_visible(q_start, window)
        seen = visible(torch.arange(q_start, q_end), torch.arange(k_start, q_end), window)
        chunks.append(QueryChunk(q_start=q_start, q_end=q_end, k_start=k_start, bias=additive(seen, dtype)))
    return tuple(chunks)


def _first_visible(position: int, window: int | None) -> int:
    return 0 if window is None else max(0, position - window + 1)


def _attention_prefill(
    row_start: int, s: SeqEntry, table: Sequence[int], block_size: int, window: int | None, dtype: torch.dtype
) -> AttentionPrefill:
    first_block = _first_visible(s.num_computed, window) // block_size
    last_block = (s.end - 1) // block_size
    blocks = int64_tensor(table[first_block : last_block + 1])
    return AttentionPrefill(row_start=row_start, num_rows=s.num_new, blocks=blocks,
                            keys=(last_block + 1 - first_block) * block_size,
                            first=s.num_computed - first_block * block_size, window=window, dtype=dtype)


@dataclass(frozen=True)
class DecodeLayout:
    """Which blocks decode row s reads (`first[s] + j` for j < num_blocks, clamped to `last[s]`) and its mask:
    what depends only on the rows' positions, the block size and the window (not on a group's block tables)."""

    first: list[int]
    last: list[int]
    num_blocks: int
    bias: torch.Tensor  # [S, 1, 1, num_blocks * block_size]


def _decode_layout(positions: list[int], block_size: int, window: int | None, dtype: torch.dtype) -> DecodeLayout:
    firsts = [_first_visible(p, window) // block_size for p in positions]
    lasts = [p // block_size for p in positions]
    num_blocks = max(last - first for first, last in zip(firsts, lasts)) + 1
    # Key l of row s sits at position first_block_s * block_size + l: hidden past the row's own position, or
    # at/before `position - window` (nothing to hide below key 0 when the window reaches back past it).
    last_key = int64_tensor([p - first * block_size for p, first in zip(positions, firsts)])[:, None]
    keys = torch.arange(num_blocks * block_size)
    hidden = keys > last_key
    if window is not None:
        hidden |= keys <= last_key - window
    bias = torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, float("-inf"))
    return DecodeLayout(first=firsts, last=lasts, num_blocks=num_blocks, bias=bias[:, None, None, :])


def _decode_blocks(tables: Sequence[Sequence[int]], layout: DecodeLayout) -> torch.Tensor:
    """Row s reads blocks first_s + j for j < nb; indices past the row's own last block repeat it (and are
    masked), so they never leave the sequence's table."""
    blocks: list[int] = []
    for first, last, table in zip(layout.first, layout.last, tables):
        blocks.extend(table[first : last + 1])
        blocks.extend([table[last]] * (layout.num_blocks - (last - first + 1)))
    return int64_tensor(blocks)


def _attention_decode(
    rows: list[int], seqs: list[SeqEntry], g: int, block_size: int, window: int | None, dtype: torch.dtype
) -> AttentionDecode:
    """Row s reads blocks first_block_s + j for j < nb (nb = the most any row needs); see `_decode_blocks`.

    Only the block lists are built per sequence in Python; the bias is a few tensor ops over all rows at once.
    """
    layout = _decode_layout([s.num_computed for s in seqs], block_size, window, dtype)
    blocks = _decode_blocks([s.block_tables[g] for s in seqs], layout)
    return AttentionDecode(rows=int64_tensor(rows), blocks=blocks, bias=layout.bias)


def _fill_gather(
    plan: DecodeKVPlan, seqs: Sequence[SeqEntry], g: int, block_size: int, dtype: torch.dtype
) -> AttentionDecode | None:
    """The blocks of the buffer rows `plan` fills from the paged cache (every position from 0; the column at a
    row's own position is written by the step's append, whether the paged write came before or not), or None when
    it fills none."""
    if not plan.fills:
        return None
    filled = [seqs[row] for row in plan.fills]
    layout = _decode_layout([s.num_computed for s in filled], block_size, None, dtype)
    blocks = _decode_blocks([s.block_tables[g] for s in filled], layout)
    return AttentionDecode(rows=int64_tensor(list(plan.fills)), blocks=blocks, bias=layout.bias)


def _decode_only_meta(
    batch: ForwardBatch, g: int, block_size: int, window: int | None, dtype: torch.dtype,
    shared: dict[tuple, DecodeLayout], plan: DecodeKVPlan | None = None,
) -> AttentionGroupMeta:
    """A step of decode rows only (every sequence one new token, rows in sequence order): the usual step. With
    `plan` the rows read DecodeKV buffers, and only the rows it fills gather their blocks; without, every row
    gathers."""
    positions = batch.decode_positions
    tables = [s.block_tables[g] for s in batch.seqs]
    write_blocks = int64_tensor([table[p // block_size] for table, p in zip(tables, positions)])
    if plan is not None:
        decode = _fill_gather(plan, batch.seqs, g, block_size, dtype)
    else:
        key = (block_size, window, dtype)
        layout = shared.get(key)
        if layout is None:
            layout = shared[key] = _decode_layout(positions, block_size, window, dtype)
        decode = AttentionDecode(rows=batch.decode_rows, blocks=_decode_blocks(tables, layout), bias=layout.bias)
    return AttentionGroupMeta(
        write_blocks=write_blocks, write_offsets=batch.positions % block_size, decode=decode, prefills=(),
        decode_kv=plan,
    )
