"""Contiguous K/V of the decoding sequences, for the attention layers.

A decode row's attention reads every earlier key of its sequence. From the paged cache that is a gather of whole
blocks per layer and step, a copy of all the keys (~6 MB per step for the default model's three full-attention
layers with 16 sequences of 320 tokens), then attention over the strided copy. Step after step most of those keys
do not change: `DecodeKV` keeps them per attention layer in a contiguous [rows, kv_heads, capacity, head_dim]
buffer, row s = the step's decode row s, so a step writes one new key per row and attention reads the buffer where
it is.

The paged cache stays the canonical KV cache (the connector reads it, the prefix cache serves from it); these
buffers are a copy on the compute side. Per attention group the buffers remember which sequence each row holds
and how many of its keys. A step's decode rows (in a decode-only step or beside prefill rows):

- a sequence a row holds at exactly this position keeps its keys: moved up to its new row if sequences before it
  left (rows only ever move up, so the moves run in ascending order without overwriting a row still to move);
- any other (a sequence that just finished its prefill, one the buffers lost) is filled from the paged cache: a
  gather of its own blocks only;
- then every row appends this step's key.

A step without decode rows leaves the buffers as they are. A sequence is known by its request id, arrival and
preemption count (`SeqEntry.key`), so a reused request id or a recomputed sequence is never taken for the keys
an earlier one left. Everything is forgotten when the buffers would exceed the byte budget (those steps gather
from the paged cache) or a forward fails (`end_runs`).

Sliding-window groups use them too: the buffers hold every position (those before the window stay as they were
and are never read again) and attention reads the columns from the earliest position any row's window starts at.

On one thread attention reads each row's own keys (`first_keys`, `end_keys`: kernels/decode_attention.py). SDPA,
on more threads, reads every row over the same columns, those the rows need together: a request with a long prompt
decoding beside short ones makes every row read its keys. Where splitting the rows in two runs (in their order)
saves at least SPLIT_MIN_KEYS key reads and half of them, attention reads each run over its own columns
(`runs_of_rows`): a second call costs about what ~2,000 key reads do on the small preset's shapes (one thread, the
AMD guest of benchmarks/README.md: 3 rows of 61 keys beside one of 1,025 in 187 against 238 us a layer, 15 rows
294 against 880), and a pulled 1,024-token request's steps beside 8 short ones took 0.79 as long
(`benchmarks/join_step.py --compare runs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from hybridpd.engine.model.step.forward_batch import int64_tensor
from hybridpd.engine.model.step.masks import additive, visible

# Budget of one layer's two buffers; a run that needs more is served by the gather path instead.
MAX_BYTES_PER_LAYER = 64 << 20
# Buffers grow by this many positions at a time (each growth copies what they hold).
LENGTH_STEP = 256
# Attention reads every row over the columns the widest row needs; the rows are read in two runs instead when
# that saves at least this many key reads and half of them (a long request decoding beside short ones).
SPLIT_MIN_KEYS = 2048


@dataclass(frozen=True)
class DecodeKVPlan:
    """One step's decode rows of one attention group."""

    rows: torch.Tensor        # [S] 0..S-1: buffer row s is the step's decode row s
    positions: torch.Tensor   # [S] each row's new key position (its length before this step)
    held_keys: tuple[int, ...]  # the same as ints: the keys a held row brings when it moves
    moves: tuple[tuple[int, int], ...]  # (from, to) buffer rows, to < from, ascending: held keys moving up
    fills: tuple[int, ...]    # buffer rows rebuilt from the paged cache (their new column: this step's append)
    held_rows: int            # rows the buffers must keep through the step (the moves' sources included)
    start: int                # attention reads buffer columns [start, length): 0, or where the first window starts
    length: int               # the largest position + 1
    window: int | None        # the group's sliding window, None for full attention
    dtype: torch.dtype        # the mask's
    first_keys: torch.Tensor  # [S] the first column each row sees (0, or where its window starts)
    end_keys: torch.Tensor    # [S] past the last: its position + 1

    # The mask and the runs serve SDPA only (attention through the compiled kernel reads first_keys / end_keys):
    # made when first asked for.
    @cached_property
    def bias(self) -> torch.Tensor:
        """[S, 1, 1, length - start]: 0 where the row sees that key, -inf where not."""
        seen = visible(self.positions, torch.arange(self.start, self.length), self.window)
        return additive(seen, self.dtype)[:, None, None, :]

    @cached_property
    def move_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`moves` as int64 arrays (sources, targets, the keys each source row holds), as kernels/buffer_moves.py
        takes them: made once a step, read by every layer of the group."""
        sources = np.array([m[0] for m in self.moves], dtype=np.int64)
        targets = np.array([m[1] for m in self.moves], dtype=np.int64)
        keys = np.array([self.held_keys[m[1]] for m in self.moves], dtype=np.int64)
        return sources, targets, keys

    @cached_property
    def runs(self) -> tuple[tuple[int, int, int, int], ...]:
        """(first row, end row, first column, end column) of each run of rows attention reads in one call: one run
        over [start, length), or two (`runs_of_rows`)."""
        return runs_of_rows(self.held_keys, self.window)


class DecodeKV:
    def __init__(self, max_bytes_per_layer: int = MAX_BYTES_PER_LAYER) -> None:
        self.max_bytes_per_layer = max_bytes_per_layer
        self._runs: dict[int, tuple[tuple[str, ...], list[int]]] = {}  # group -> (row keys, lengths held)
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> K and V buffers
        self._storage: object | None = None

    def plan(self, group_id: int, keys: Sequence[str | None], positions: list[int], token_bytes: int,
             dtype: torch.dtype, window: int | None = None) -> DecodeKVPlan | None:
        """The step's decode rows (`keys`, `positions` in row order): which held rows move, which are filled, and
        the mask. None (and the group's rows are forgotten) when a sequence has no key or the buffers would exceed
        the budget: then the step gathers from the paged cache. `token_bytes`: one token's K (or V) in one layer of
        the group; `window`: a sliding window's size."""
        held_keys, held_lengths = self._runs.get(group_id, ((), []))
        length = max(positions) + 1
        capacity = -(-length // LENGTH_STEP) * LENGTH_STEP
        rows_needed = max(len(keys), len(held_keys))
        if None in keys or 2 * rows_needed * capacity * token_bytes > self.max_bytes_per_layer:
            self._runs.pop(group_id, None)
            return None
        where = {key: (row, held) for row, (key, held) in enumerate(zip(held_keys, held_lengths))}
        moves: list[tuple[int, int]] = []
        fills: list[int] = []
        last_source = -1
        for row, (key, position) in enumerate(zip(keys, positions)):
            source, held = where.get(key, (-1, -1))
            # Rows only move up, in order: a held row below one already taken (another order) is filled instead.
            if held != position or source < row or source <= last_source:
                fills.append(row)
                continue
            last_source = source
            if source != row:
                moves.append((source, row))
        self._runs[group_id] = (tuple(keys), [p + 1 for p in positions])  # type: ignore[arg-type]
        position_tensor = int64_tensor(positions)
        start = 0 if window is None else max(0, min(positions) - window + 1)
        first_keys = (torch.zeros_like(position_tensor) if window is None
                      else (position_tensor - (window - 1)).clamp_(min=0))
        return DecodeKVPlan(rows=torch.arange(len(positions)), positions=position_tensor, held_keys=tuple(positions),
                            moves=tuple(moves), fills=tuple(fills), held_rows=rows_needed, start=start,
                            length=length, window=window, dtype=dtype, first_keys=first_keys,
                            end_keys=position_tensor + 1)

    def end_runs(self) -> None:
        """A failed forward: some layers may have written their buffers, others not; every row is stale."""
        self._runs.clear()

    def bind(self, storage: object) -> None:
        """The paged cache the next step reads: another one than the last step's ends every run."""
        if storage is not self._storage:
            self._runs.clear()
            self._storage = storage

    def buffers(self, layer_id: int, plan: DecodeKVPlan, kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V buffers for this step, [>= plan.held_rows, kv_heads, >= plan.length, head_dim]. Too
        small ones are replaced by buffers of exactly the rows the plan needs and its length rounded up to
        LENGTH_STEP (so they stay within the byte budget the plan was checked against), keeping what the old ones
        held there."""
        held = self._buffers.get(layer_id)
        if held is not None and held[0].shape[0] >= plan.held_rows and held[0].shape[2] >= plan.length and (
            held[0].dtype == dtype
        ):
            return held
        shape = (plan.held_rows, kv_heads, -(-plan.length // LENGTH_STEP) * LENGTH_STEP, head_dim)
        # Zeros, not empty: attention multiplies masked keys too, and a NaN bit pattern there would survive the
        # -inf of the mask; past the rows' positions the buffers only ever hold zeros or earlier real keys.
        grown = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
        if held is not None and held[0].dtype == dtype:
            rows, columns = min(shape[0], held[0].shape[0]), min(shape[2], held[0].shape[2])
            for new, old in zip(grown, held):
                new[:rows, :, :columns] = old[:rows, :, :columns]
        self._buffers[layer_id] = grown
        return grown


def runs_of_rows(positions: Sequence[int], window: int | None) -> tuple[tuple[int, int, int, int], ...]:
    """The runs of rows attention reads the buffers in: (first row, end row, first column, end column) each. One run
    over the columns the rows need together, or, where the rows split in two (in their order) into runs that need
    far fewer columns between them (`SPLIT_MIN_KEYS`, and at most half the key reads), those two. Rows close
    together return at once; otherwise every split point is weighed in one pass of numpy (~14 us a group whatever
    the rows, where a loop in Python took 25 us at 16 rows and 89 at 64)."""
    n, lo, hi = len(positions), min(positions), max(positions)
    if n * (hi - lo) < SPLIT_MIN_KEYS:   # no split saves more than this: a row reads at most hi - lo keys fewer
        return ((0, n, 0 if window is None else max(0, lo - window + 1), hi + 1),)
    p = np.asarray(positions, dtype=np.int64)
    head_lo, head_hi = np.minimum.accumulate(p), np.maximum.accumulate(p)          # rows [0, k + 1)
    tail_lo, tail_hi = np.minimum.accumulate(p[::-1])[::-1], np.maximum.accumulate(p[::-1])[::-1]   # rows [k, n)
    if window is None:
        head_first, tail_first = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    else:
        head_first, tail_first = np.maximum(0, head_lo - window + 1), np.maximum(0, tail_lo - window + 1)
    whole = (0, n, int(head_first[-1]), int(head_hi[-1]) + 1)
    reads = n * (whole[3] - whole[2])
    k = np.arange(1, n)   # rows [0, k) and [k, n)
    splits = k * (head_hi[:-1] + 1 - head_first[:-1]) + (n - k) * (tail_hi[1:] + 1 - tail_first[1:])
    at = int(splits.argmin())
    best = int(splits[at])
    if reads - best < SPLIT_MIN_KEYS or 2 * best > reads:
        return (whole,)
    cut = at + 1
    return ((0, cut, int(head_first[at]), int(head_hi[at]) + 1), (cut, n, int(tail_first[cut]), int(tail_hi[cut]) + 1))
