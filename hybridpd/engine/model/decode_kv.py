"""Contiguous K/V of the sequences in a run of decode-only steps, for the attention layers.

A decode step's attention reads every earlier key of every sequence. From the paged cache that is a gather of
whole blocks per layer and step, a copy of all the keys (~6 MB per step for the default model's three
full-attention layers with 16 sequences of 320 tokens), then attention over the strided copy. While the same
sequences decode step after step, none of those keys changes: `DecodeKV` keeps them per attention layer in a
contiguous [rows, kv_heads, capacity, head_dim] buffer (row s = the step's sequence s), so a step writes one new key
per row and attention reads the buffer where it is.

The paged cache stays the canonical KV cache (the connector reads it, the prefix cache serves from it); these
buffers are a copy on the compute side, rebuilt from it (one gather, what every step did before) whenever the run
breaks. Per attention group:

    IDLE --decode-only step--> FILLED(keys, lengths) --next step, same keys at positions == lengths--> FILLED ...
    FILLED --any other step: other sequences or order, a position the buffer does not end at, a step that is
             not decode-only, a batch over the byte budget, a failed forward--> IDLE (the next step refills)

Sliding-window groups use them too: the buffers hold every position (those before the window stay as they were
and are never read again) and attention reads the columns from the earliest position any row's window starts at.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridpd.engine.model.forward_batch import int64_tensor
from hybridpd.engine.model.masks import additive, visible

# Budget of one layer's two buffers; a run that needs more is served by the gather path instead.
MAX_BYTES_PER_LAYER = 64 << 20
# Buffers grow by this many positions at a time (each growth copies what they hold).
LENGTH_STEP = 256


@dataclass(frozen=True)
class DecodeKVPlan:
    """One decode-only step of one attention group."""

    refill: bool              # rows [0, S) are rebuilt from the paged cache (after this step's write)
    rows: torch.Tensor        # [S] 0..S-1
    positions: torch.Tensor   # [S] each row's new key position (its length before this step)
    start: int                # attention reads buffer columns [start, length): 0, or where the first window starts
    length: int               # the largest position + 1
    bias: torch.Tensor        # [S, 1, 1, length - start]: 0 where the row sees that key, -inf where not


class DecodeKV:
    def __init__(self, max_bytes_per_layer: int = MAX_BYTES_PER_LAYER) -> None:
        self.max_bytes_per_layer = max_bytes_per_layer
        self._runs: dict[int, tuple[tuple[str, ...], list[int]]] = {}  # group -> (sequence keys, lengths held)
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> K and V buffers
        self._storage: object | None = None

    def plan(self, group_id: int, keys: Sequence[str | None], positions: list[int], token_bytes: int,
             dtype: torch.dtype, window: int | None = None) -> DecodeKVPlan | None:
        """A decode-only step: append to the run if it continues, else refill. None (and the run ends) when a
        sequence has no key or the buffers would exceed the budget: then the step gathers from the paged cache.
        `token_bytes`: one token's K (or V) in one layer of the group; `window`: a sliding window's size."""
        length = max(positions) + 1
        capacity = -(-length // LENGTH_STEP) * LENGTH_STEP
        if None in keys or 2 * len(keys) * capacity * token_bytes > self.max_bytes_per_layer:
            self._runs.pop(group_id, None)
            return None
        run_keys = tuple(keys)  # type: ignore[arg-type]
        held = self._runs.get(group_id)
        refill = held is None or held[0] != run_keys or held[1] != positions
        self._runs[group_id] = (run_keys, [p + 1 for p in positions])
        position_tensor = int64_tensor(positions)
        start = 0 if window is None else max(0, min(positions) - window + 1)
        bias = additive(visible(position_tensor, torch.arange(start, length), window), dtype)
        return DecodeKVPlan(refill=refill, rows=torch.arange(len(positions)), positions=position_tensor,
                            start=start, length=length, bias=bias[:, None, None, :])

    def end_runs(self) -> None:
        """A step that is not decode-only (or failed): every buffer is stale from here on."""
        self._runs.clear()

    def bind(self, storage: object) -> None:
        """The paged cache the next step reads: another one than the last step's ends every run."""
        if storage is not self._storage:
            self._runs.clear()
            self._storage = storage

    def buffers(self, layer_id: int, plan: DecodeKVPlan, kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V buffers for this step, [>= rows, kv_heads, >= plan.length, head_dim]. Too small
        ones are replaced by buffers of exactly the rows and the length rounded up to LENGTH_STEP; on an append
        step (a run going on past the length they hold) the keys they hold are copied over."""
        rows = plan.positions.shape[0]
        held = self._buffers.get(layer_id)
        if held is not None and held[0].shape[0] >= rows and held[0].shape[2] >= plan.length and (
            held[0].dtype == dtype
        ):
            return held
        shape = (rows, kv_heads, -(-plan.length // LENGTH_STEP) * LENGTH_STEP, head_dim)
        # Zeros, not empty: attention multiplies masked keys too, and a NaN bit pattern there would survive the
        # -inf of the mask; past the rows' positions the buffers only ever hold zeros or earlier real keys.
        grown = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
        if held is not None and not plan.refill:
            kept = min(rows, held[0].shape[0]), min(shape[2], held[0].shape[2])
            for new, old in zip(grown, held):
                new[: kept[0], :, : kept[1]] = old[: kept[0], :, : kept[1]]
        self._buffers[layer_id] = grown
        return grown
