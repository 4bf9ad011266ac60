"""Where each Mamba prefill row goes when all prefill sequences of a step are convolved and scanned together.

Per step and KV group (computed once, shared by that group's layers). For P prefill sequences, sequence i has
`n_i` new rows starting at row `r_i` of the step, `c_i = num_computed_i` tokens already in its slot, and
`front_i = c_i % chunk_size`. Three layouts:

- conv input `X` [P, K - 1 + n_max, conv_dim] (K = d_conv): the K - 1 inputs before the chunk (the slot's conv
  state, zeros for a fresh sequence), then the n_i new rows, then zeros. It is gathered from the source table
  `xbc rows [T] ++ previous conv states [P * (K - 1)] ++ one zero row` by `conv_index`.
- conv output `[P * n_max]` rows (+ one zero row): row i * n_max + j is new row j of sequence i.
- scan layout [P, L] with L = chunks * chunk_size: new row j of sequence i sits at front_i + j, so chunk
  boundaries fall on absolute positions that are multiples of chunk_size; every other place is padding
  (zero input, dt = 0, which leaves the state unchanged). `scan_index` gathers it from the conv output rows,
  `dt_index` from the step's dt rows [T] (+ one zero row).

Saved states: boundary k of sequence i (the state after `c_i - front_i + k * chunk_size` tokens) is row
k * P + i of the flattened boundary states (chunk-major, as `chunked_scan` returns them); the last boundary is the state at the step's end because
trailing padding chunks repeat it. A saved conv state is the K - 1 inputs before the save point, rows of X.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class MambaPrefillLayout:
    num_seqs: int
    max_rows: int                 # n_max
    chunks: int                   # per sequence in the scan layout
    slots: torch.Tensor           # [P] running state slots
    resumed: torch.Tensor         # [P] bool, num_computed > 0: start from the slot, else from zeros
    conv_index: torch.Tensor      # [P, K - 1 + n_max] into the conv source table
    scan_index: torch.Tensor      # [P, L] into the conv output rows
    dt_index: torch.Tensor        # [P, L] into the step's rows (T = the zero row)
    out_rows: torch.Tensor        # [R] rows of the step that are prefill rows, in sequence order
    out_index: torch.Tensor       # [R] their places in the flattened scan layout [P * L]
    state_index: torch.Tensor     # [V] rows of the flattened boundary states to store
    conv_save_index: torch.Tensor  # [V, K - 1] rows of the flattened X to store as conv states
    save_slots: torch.Tensor      # [V] where: the saves asked for, then each sequence's running slot
    # True when the layouts are the identity: the step is these sequences only, in order, each with n_max rows
    # starting on a chunk boundary, and n_max a multiple of chunk_size. Then the conv output rows ARE the scan
    # layout, dt needs no gather and the scan output rows are the step's rows.
    aligned: bool = False


@dataclass(frozen=True, kw_only=True)
class PrefillSeq:
    row_start: int
    num_rows: int
    num_computed: int
    slot: int
    saves: tuple[tuple[int, int], ...]  # (num_tokens, slot)


def build_prefill_layout(
    seqs: list[PrefillSeq], num_step_rows: int, chunk_size: int, conv_width: int
) -> MambaPrefillLayout:
    """`conv_width` = d_conv - 1. Raises ValueError for a save that is neither on a chunk boundary nor the end."""
    num = len(seqs)
    max_rows = max(s.num_rows for s in seqs)
    fronts = [s.num_computed % chunk_size for s in seqs]
    chunks = max(-(-(f + s.num_rows) // chunk_size) for f, s in zip(fronts, seqs))
    length = chunks * chunk_size
    zero_source = num_step_rows + num * conv_width
    zero_conv = num * max_rows

    conv_index = torch.full((num, conv_width + max_rows), zero_source, dtype=torch.long)
    scan_index = torch.full((num, length), zero_conv, dtype=torch.long)
    dt_index = torch.full((num, length), num_step_rows, dtype=torch.long)
    out_rows, out_index, saves, running = [], [], [], []
    for i, (s, front) in enumerate(zip(seqs, fronts)):
        n = s.num_rows
        if s.num_computed > 0:
            conv_index[i, :conv_width] = torch.arange(conv_width) + num_step_rows + i * conv_width
        conv_index[i, conv_width : conv_width + n] = torch.arange(s.row_start, s.row_start + n)
        scan_index[i, front : front + n] = torch.arange(i * max_rows, i * max_rows + n)
        dt_index[i, front : front + n] = torch.arange(s.row_start, s.row_start + n)
        out_rows.append(torch.arange(s.row_start, s.row_start + n))
        out_index.append(torch.arange(i * length + front, i * length + front + n))
        end = s.num_computed + n
        first_boundary = s.num_computed - front
        for num_tokens, slot in (*s.saves, (end, s.slot)):
            if num_tokens != end and num_tokens % chunk_size:
                raise ValueError(
                    f"mamba save at {num_tokens} tokens: not a multiple of mamba_chunk_size ({chunk_size}) "
                    f"nor the step's end ({end})"
                )
            k = chunks if num_tokens == end else (num_tokens - first_boundary) // chunk_size
            first_input = i * (conv_width + max_rows) + num_tokens - s.num_computed
            entry = (k * num + i, list(range(first_input, first_input + conv_width)), slot)
            (running if num_tokens == end and slot == s.slot else saves).append(entry)
    entries = saves + running
    aligned = (
        length == max_rows and num_step_rows == num * max_rows
        and all(f == 0 and s.num_rows == max_rows and s.row_start == i * max_rows
                for i, (f, s) in enumerate(zip(fronts, seqs)))
    )
    return MambaPrefillLayout(
        num_seqs=num,
        max_rows=max_rows,
        chunks=chunks,
        slots=torch.tensor([s.slot for s in seqs], dtype=torch.long),
        resumed=torch.tensor([s.num_computed > 0 for s in seqs], dtype=torch.bool),
        conv_index=conv_index,
        scan_index=scan_index,
        dt_index=dt_index,
        out_rows=torch.cat(out_rows),
        out_index=torch.cat(out_index),
        state_index=torch.tensor([e[0] for e in entries], dtype=torch.long),
        conv_save_index=torch.tensor([e[1] for e in entries], dtype=torch.long).view(len(entries), conv_width),
        save_slots=torch.tensor([e[2] for e in entries], dtype=torch.long),
        aligned=aligned,
    )
