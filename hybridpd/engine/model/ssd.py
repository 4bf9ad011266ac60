"""Mamba2's chunked state-space-duality (SSD) scan, batched over sequences, and its one-token recurrent step.

The recurrence per head h (state S of shape [head_dim, d_state]):
    S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t B_t^T        y_t = S_t C_t
The chunked form splits time into chunks of `chunk_size`: inside a chunk the output is a masked
attention-like product (the "diagonal" term); across chunks only the states at chunk boundaries are carried.
Chunk boundaries are aligned to ABSOLUTE positions: the scan of tokens starting at position p is front-padded
with `p % chunk_size` tokens whose dt is 0 (decay exp(0) = 1, input 0), which leaves the state untouched, and
back-padded the same way (up to the longest sequence of the batch; the caller lays the rows out). So the states at boundaries are exactly the states after a multiple of
`chunk_size` tokens of the sequence, whatever chunking of the prompt the scheduler chose.
"""

from __future__ import annotations

import torch


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """a [..., L] -> [..., L, L] with [i, j] = a[j+1] + ... + a[i] for j <= i, -inf above the diagonal."""
    length = a.shape[-1]
    cum = torch.cumsum(a, dim=-1)
    seg = cum[..., :, None] - cum[..., None, :]
    upper = torch.ones(length, length, dtype=torch.bool).triu(1)
    return seg.masked_fill(upper, float("-inf"))


def chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    initial_state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scan S sequences at once, each already laid out on whole chunks aligned to absolute positions.

    x [S, L, H, P], dt [S, L, H] (after softplus/clamp; 0 on padding), A [H] (negative), B/C [S, L, G, N] per
    group (head h belongs to group h // (H / G)), initial_state [S, H, P, N]: the state at position 0 of each
    row. L is a multiple of `chunk_size`. All float32. Returns y [S, L, H, P] (without the D skip) and the states
    at every chunk boundary [S, L / chunk_size + 1, H, P, N] ([k] = the state after k chunks). Padding (dt = 0,
    x = 0) leaves the state as it is, so trailing padding chunks repeat the last real boundary state.

    B and C stay per group: every product that involves them is taken per group (C.B, B x, C state) and the
    per-head decays are applied to the other factor, so nothing is expanded to heads.
    """
    seqs, length, heads, head_dim = x.shape
    groups, d_state = B.shape[-2], B.shape[-1]
    per_group = heads // groups
    chunks = length // chunk_size
    # Working layout [S, c, H, l, P]: per (sequence, chunk, head) plain matrices, so every product is a matmul
    # with a contiguous output. B and C stay per group [S, c, G, 1, l, N] and broadcast over the group's heads.
    xdt = (x * dt[..., None]).view(seqs, chunks, chunk_size, heads, head_dim).transpose(2, 3).contiguous()
    B = B.reshape(seqs, chunks, chunk_size, groups, d_state).transpose(2, 3)[:, :, :, None]
    C = C.reshape(seqs, chunks, chunk_size, groups, d_state).transpose(2, 3)[:, :, :, None]
    a = (dt * A).view(seqs, chunks, chunk_size, heads).transpose(2, 3)  # [S, c, H, l]
    a_cum = torch.cumsum(a, dim=-1)

    def by_group(t: torch.Tensor) -> torch.Tensor:
        """[S, c, H, ...] -> [S, c, G, H / G, ...]."""
        return t.view(seqs, chunks, groups, per_group, *t.shape[3:])

    # Diagonal blocks: y[l] += sum_{s <= l} (C_l . B_s) exp(a[s+1..l]) xdt_s
    decay = torch.exp(_segment_sums(a))  # [S, c, H, l, s]
    scores = by_group(decay).mul_(torch.matmul(C, B.transpose(-1, -2)))  # [S, c, G, H / G, l, s]
    y = torch.matmul(scores.view(seqs, chunks, heads, chunk_size, chunk_size), xdt)  # [S, c, H, l, P]

    # Each chunk's own contribution to the state at its end: sum_l exp(a[l+1..end]) xdt_l B_l^T.
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [S, c, H, l]
    weighted = by_group(xdt * to_end[..., None]).transpose(-1, -2)  # [S, c, G, H / G, P, l]
    chunk_states = torch.matmul(weighted, B).view(seqs, chunks, heads, head_dim, d_state)

    # States at every boundary, chunk by chunk: boundary k + 1 = exp(total decay of chunk k) * boundary k + chunk k's
    # own contribution (boundary 0 is the initial state). A few in-place steps; no [c + 1, c + 1] mixing matrix.
    chunk_decay = torch.exp(a_cum[..., -1])[..., None, None]  # [S, c, H, 1, 1]
    boundary = x.new_empty(seqs, chunks + 1, heads, head_dim, d_state)
    boundary[:, 0] = initial_state
    for k in range(chunks):
        torch.addcmul(chunk_states[:, k], boundary[:, k], chunk_decay[:, k], out=boundary[:, k + 1])

    # Off-diagonal: the state entering each chunk, read out by C and decayed to each position.
    # Taken transposed ([P, N] @ [N, l]), so that the states are read in place rather than copied transposed.
    y_in_t = torch.matmul(by_group(boundary[:, :-1]), C.transpose(-1, -2))  # [S, c, G, H / G, P, l]
    y.addcmul_(y_in_t.view(seqs, chunks, heads, head_dim, chunk_size).transpose(-1, -2), torch.exp(a_cum)[..., None])
    return y.transpose(2, 3).reshape(seqs, length, heads, head_dim), boundary


def recurrent_step_(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> torch.Tensor:
    """Batched single step, updating `state` in place. state [S, H, P, N], x [S, H, P], dt [S, H], A [H],
    B/C [S, H, N] -> y [S, H, P]."""
    decay = torch.exp(dt * A[None, :])[..., None, None]
    state.mul_(decay).addcmul_((dt[..., None] * x)[..., None], B[:, :, None, :])
    # A multiply-and-sum, not a matmul: a batch of [P, N] @ [N] matvecs is slow through BLAS.
    return (state * C[:, :, None, :]).sum(-1)
