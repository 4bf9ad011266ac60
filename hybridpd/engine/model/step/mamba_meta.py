"""Mamba metadata of one step for one KV group: every sequence's rows in order, as the compiled kernel walks them
(fused_mamba.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hybridpd.engine.kv_cache.spec import MambaSpec
from hybridpd.engine.model.step.forward_batch import ForwardBatch, SeqEntry


@dataclass(frozen=True)
class MambaRows:
    """A group's step as the compiled kernel walks it (fused_mamba.py): sequence q's rows
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


def mamba_group_meta(batch: ForwardBatch, group_id: int, spec: MambaSpec) -> MambaRows:
    conv_dtype, ssm_dtype = spec.dtypes
    if conv_dtype != torch.float32 or ssm_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"Mamba states must be a float32 window and a float32 or bfloat16 SSM state (the compiled "
                         f"kernel's), not {spec.dtypes}")
    return _mamba_rows(batch, group_id)


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
