"""Mamba metadata of one step for one KV group.

Float32 states: every sequence's rows in order, for the compiled kernel (fused_mamba.py). Other dtypes: decode rows
(one new token, num_computed > 0) as one batched recurrent step, all other sequences as one batched convolution and
chunked scan (mamba_layout.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hybridpd.engine.kv_cache.spec import MambaSpec
from hybridpd.engine.model.step.forward_batch import ForwardBatch, SeqEntry, int64_tensor
from hybridpd.engine.model.step.mamba_layout import MambaPrefillLayout, PrefillSeq, build_prefill_layout


@dataclass(frozen=True)
class MambaDecode:
    rows: torch.Tensor   # [Sd] rows of T
    slots: torch.Tensor  # [Sd] running state slots
    saves: tuple[tuple[int, int], ...]  # (index into rows, slot): copy that row's new state to slot
    # When the slots are an ascending arithmetic progression (the usual case: slots taken in admission order),
    # the slice that selects exactly them, in order: a view, so the states are updated where they are.
    slot_slice: slice | None = None


def _progression(values: list[int]) -> slice | None:
    """The slice `s` with `range(...)[s] == values` if `values` is ascending with one constant step, else None."""
    step = values[1] - values[0] if len(values) > 1 else 1
    if step < 1 or any(b - a != step for a, b in zip(values, values[1:])):
        return None
    return slice(values[0], values[-1] + 1, step)


@dataclass(frozen=True)
class MambaRows:
    """A float32 group's step as the compiled kernels walk it (fused_mamba.py): sequence q's rows
    [starts[q], starts[q] + lengths[q]) in order, from its slot's state (resumed 1) or from zeros (0); after row
    `save_after[v]` of sequence `save_seqs[v]` (ordered by sequence, then row) the state is also copied to
    `save_slots[v]`. All int64 numpy arrays ([Q] or [V]): the kernels are their only readers."""

    starts: np.ndarray
    lengths: np.ndarray
    resumed: np.ndarray
    slots: np.ndarray
    save_seqs: np.ndarray
    save_after: np.ndarray
    save_slots: np.ndarray


@dataclass(frozen=True)
class MambaGroupMeta:
    decode: MambaDecode | None
    prefill: MambaPrefillLayout | None  # every other sequence, convolved and scanned together
    rows: MambaRows | None = None  # float32 caches: every sequence, for the kernel (then decode/prefill are None)


def mamba_group_meta(batch: ForwardBatch, group_id: int, spec: MambaSpec, chunk_size: int) -> MambaGroupMeta:
    if fused_mamba(spec):
        return MambaGroupMeta(decode=None, prefill=None, rows=_mamba_rows(batch, group_id))
    return _mamba_meta(batch, group_id, chunk_size, spec.conv_state_shape[0])


def fused_mamba(spec: MambaSpec) -> bool:
    """Float32 states: the group's steps run the compiled kernel (fused_mamba.py); other dtypes the torch path."""
    return all(dtype == torch.float32 for dtype in spec.dtypes)


def _checked_saves(s: SeqEntry, g: int) -> tuple[tuple[int, int], ...]:
    saves = s.mamba_saves[g] if s.mamba_saves else ()
    for num_tokens, _ in saves:
        if not s.num_computed < num_tokens <= s.end:
            raise ValueError(f"mamba save at {num_tokens} tokens is outside this step ({s.num_computed}, {s.end}]")
    return saves


def _mamba_rows(batch: ForwardBatch, g: int) -> MambaRows:
    save_seqs, save_after, save_slots = [], [], []
    for q, s in enumerate(batch.seqs):
        for num_tokens, slot in sorted(_checked_saves(s, g)):
            save_seqs.append(q)
            save_after.append(num_tokens - s.num_computed)
            save_slots.append(slot)
    return MambaRows(
        starts=_int64_array(batch.row_starts), lengths=_int64_array([s.num_new for s in batch.seqs]),
        resumed=_int64_array([int(s.num_computed > 0) for s in batch.seqs]),
        slots=_int64_array([s.block_tables[g][0] for s in batch.seqs]),
        save_seqs=_int64_array(save_seqs), save_after=_int64_array(save_after), save_slots=_int64_array(save_slots),
    )


def _int64_array(values: Sequence[int]) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _mamba_meta(batch: ForwardBatch, g: int, chunk_size: int, conv_width: int) -> MambaGroupMeta:
    decode_rows, decode_slots, decode_saves, prefills = [], [], [], []
    for row_start, s in zip(batch.row_starts, batch.seqs):
        slot = int(s.block_tables[g][0])
        saves = _checked_saves(s, g)
        if s.num_new == 1 and s.num_computed > 0:
            decode_saves.extend((len(decode_rows), save_slot) for _, save_slot in saves)
            decode_rows.append(row_start)
            decode_slots.append(slot)
        else:
            prefills.append(PrefillSeq(
                row_start=row_start, num_rows=s.num_new, num_computed=s.num_computed, slot=slot, saves=tuple(saves)
            ))
    decode = None
    if decode_rows:
        decode = MambaDecode(
            rows=int64_tensor(decode_rows), slots=int64_tensor(decode_slots), saves=tuple(decode_saves),
            slot_slice=_progression(decode_slots),
        )
    prefill = build_prefill_layout(prefills, batch.input_ids.shape[0], chunk_size, conv_width) if prefills else None
    return MambaGroupMeta(decode=decode, prefill=prefill)
