"""What one forward step computes: the new tokens of some sequences, and where their cache lives."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch


def int64_tensor(values: Sequence[int]) -> torch.Tensor:
    """[len(values)] int64 from Python ints, through a packed buffer (a few times faster than `torch.tensor`
    on a list, which matters for the per-step index tensors). The tensor owns a reference to the buffer."""
    if not values:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(array("q", values), dtype=torch.long)


@dataclass(frozen=True)
class SeqEntry:
    """One sequence of a step.

    `block_tables[g]` (group order of `KVCacheStorage.groups`), block ids as Python ints:
    - attention groups: logical block index -> block id (0 = the null block, only where a sliding window no
      longer needs that block);
    - Mamba groups: `[state_slot]`, the running state; read when `num_computed > 0`, written at the step's end.
    `mamba_saves[g]`: `(num_tokens, slot)` pairs: after tokens `[0, num_tokens)` of this sequence, also write
    the conv + ssm state to `slot`. `num_computed < num_tokens <= num_computed + num_new` (the scheduler takes
    them at multiples of the Mamba cache interval). Empty for attention groups.
    """

    num_computed: int
    num_new: int
    block_tables: tuple[Sequence[int], ...]
    mamba_saves: tuple[tuple[tuple[int, int], ...], ...] = ()
    # The sequence's identity across steps, for DecodeKV: request id, arrival and preemption count, so that a reused
    # request id or a recomputed sequence is another key.
    key: str | None = None

    @property
    def end(self) -> int:
        return self.num_computed + self.num_new


@dataclass(frozen=True)
class ForwardBatch:
    """`input_ids`/`positions`: [T] int64, the sequences' new tokens concatenated in `seqs` order.

    `logits_indices`: [S] rows of T whose logits `PagedCausalLM.forward` returns.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    seqs: tuple[SeqEntry, ...]
    logits_indices: torch.Tensor

    def __post_init__(self) -> None:
        total = sum(s.num_new for s in self.seqs)
        if self.input_ids.shape != (total,) or self.positions.shape != (total,):
            raise ValueError(
                f"input_ids {tuple(self.input_ids.shape)} and positions {tuple(self.positions.shape)} must both "
                f"be [{total}] (the sum of num_new)"
            )
        if any(s.num_new < 1 or s.num_computed < 0 for s in self.seqs):
            raise ValueError("every sequence needs num_new >= 1 and num_computed >= 0")

    @cached_property
    def all_decode(self) -> bool:
        """Every sequence computes one new token (its rows are then 0..S-1 in sequence order)."""
        return all(s.num_new == 1 for s in self.seqs)

    @cached_property
    def decode_positions(self) -> list[int]:
        """Each sequence's first new position (its only one in an `all_decode` step)."""
        return [s.num_computed for s in self.seqs]

    @cached_property
    def decode_rows(self) -> torch.Tensor:
        """[S] the rows 0..S-1 (of an `all_decode` step)."""
        return torch.arange(len(self.seqs))

    @property
    def row_starts(self) -> tuple[int, ...]:
        """First row of each sequence in T."""
        starts, row = [], 0
        for s in self.seqs:
            starts.append(row)
            row += s.num_new
        return tuple(starts)
