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


def chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    initial_state: torch.Tensor,
    chunk_size: int,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scan S sequences at once, each already laid out on whole chunks aligned to absolute positions.

    x [S, L, H, P], dt [S, L, H] (after softplus/clamp; 0 on padding), A and D [H] (A negative), B/C [S, L, G, N]
    per group (head h belongs to group h // (H / G)), initial_state [S, H, P, N]: the state at position 0 of each
    row. L is a multiple of `chunk_size`; the inputs may be strided views (e.g. columns of the conv output). All
    float32. Returns y [S, L, H, P] WITH the D skip (written into `out` if given, which must be contiguous) and
    the states at every chunk boundary, chunk-major: [L / chunk_size + 1, S, H, P, N] ([k, i] = the state of
    row i after k chunks). Padding (dt = 0, x = 0) leaves the state as it is, so trailing padding chunks repeat
    the last real boundary state.

    The working layout is chunk-major [c, S, H, l, P]: every (chunk, sequence, head) is a plain matrix and the
    three matmuls (diagonal blocks, chunk states, the read-out of incoming states) are single batched products
    over ONE batch dimension c * S * H, reading their operands in place and writing contiguous outputs. The
    chunk-major order is what lets the incoming states boundary[:-1] be such an operand without a copy, and
    keeps the boundary recurrence on contiguous [S, H, P, N] slices. Going in and out of this layout costs one
    elementwise pass each way, fused with work that is needed anyway (x * dt on the way in, + D x on the way out).
    B and C stay per group: C.B is taken per group, and the per-head decays are folded into per-head copies of
    B and C ([c, S, H, l, N], half the size of x) rather than into x.
    """
    seqs, length, heads, head_dim = x.shape
    groups, d_state = B.shape[-2], B.shape[-1]
    per_group = heads // groups
    chunks = length // chunk_size

    def chunk_major(t: torch.Tensor) -> torch.Tensor:
        """[S, L, H, ...] -> [c, S, H, l, ...] (a view)."""
        return t.unflatten(1, (chunks, chunk_size)).transpose(0, 1).transpose(2, 3)

    def by_group(t: torch.Tensor) -> torch.Tensor:
        """[c, S, H, ...] -> [c, S, G, H / G, ...]."""
        return t.view(chunks, seqs, groups, per_group, *t.shape[3:])

    dt_c = chunk_major(dt)  # [c, S, H, l]
    a_cum = torch.cumsum(dt_c * A[:, None], dim=-1)  # [c, S, H, l], non-increasing along l (dt >= 0, A < 0)
    xdt = torch.mul(chunk_major(x), dt_c[..., None], out=x.new_empty(chunks, seqs, heads, chunk_size, head_dim))
    B_c, C_c = chunk_major(B), chunk_major(C)  # [c, S, G, l, N]

    # Diagonal blocks: y[l] = sum_{s <= l} (C_l . B_s) exp(a[s+1..l]) xdt_s. The differences a_cum[l] - a_cum[s]
    # are <= 0 on and below the diagonal and >= 0 above it: clamping them to 0 keeps every exp finite (no -inf,
    # which takes exp's slow path, and no overflow), and the zeros of the lower-triangular C.B mask them.
    decay = (a_cum[..., :, None] - a_cum[..., None, :]).clamp_(max=0).exp_()  # [c, S, H, l, s]
    by_group(decay).mul_(torch.matmul(C_c, B_c.transpose(-1, -2)).tril_()[:, :, :, None])
    y = torch.matmul(decay, xdt)  # [c, S, H, l, P]

    # Each chunk's own contribution to the state at its end: sum_l xdt_l (exp(a[l+1..end]) B_l)^T.
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [c, S, H, l]
    B_h = (by_group(to_end)[..., None] * B_c[:, :, :, None]).view(chunks, seqs, heads, chunk_size, d_state)
    chunk_states = torch.matmul(xdt.transpose(-1, -2), B_h)  # [c, S, H, P, N]

    # States at every boundary, chunk by chunk: boundary k + 1 = exp(total decay of chunk k) * boundary k + chunk
    # k's own contribution. Contiguous slices; no [c + 1, c + 1] mixing matrix.
    chunk_decay = torch.exp(a_cum[..., -1])[..., None, None]  # [c, S, H, 1, 1]
    boundary = x.new_empty(chunks + 1, seqs, heads, head_dim, d_state)
    boundary[0] = initial_state
    for k in range(chunks):
        torch.addcmul(chunk_states[k], boundary[k], chunk_decay[k], out=boundary[k + 1])

    # Off-diagonal: the state entering each chunk, read out by C decayed to each position (exp(a[1..l]) C_l),
    # accumulated into y in place. Taken as [l, N] @ [N, P] so that the states are read transposed in place.
    C_h = (by_group(torch.exp(a_cum))[..., None] * C_c[:, :, :, None]).view(-1, chunk_size, d_state)
    y.view(-1, chunk_size, head_dim).baddbmm_(C_h, boundary[:-1].view(-1, head_dim, d_state).transpose(1, 2))

    if out is None:
        out = x.new_empty(seqs, length, heads, head_dim)
    shape = (seqs, chunks, chunk_size, heads, head_dim)
    torch.addcmul(y.permute(1, 0, 3, 2, 4), D[:, None], x.reshape(shape), out=out.view(shape))
    return out, boundary


def recurrent_step_(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor,
) -> torch.Tensor:
    """Batched single step, updating `state` in place. state [S, H, P, N] (each [H, P, N] contiguous), x [S, H, P],
    dt [S, H], A and D [H], B/C [S, G, N] per group -> y [S, H, P] with the D skip.

    A group's heads share B and C, so the state is taken per group as [S, G, (H / G) P, N]: B and C broadcast
    without being expanded to heads, and the read-out y = state C is one row-vector product per (sequence,
    group), C [1, N] @ state^T [N, (H / G) P]. That orientation matters: as state @ C (a batch of matrix-vector
    products) BLAS is ~5x slower, and a multiply-and-sum writes and re-reads a temporary the size of the state."""
    seqs, heads, head_dim, d_state = state.shape
    groups = B.shape[1]
    grouped = state.view(seqs, groups, -1, d_state)
    state.mul_(torch.exp(dt * A)[..., None, None])
    grouped.addcmul_((dt[..., None] * x).view(seqs, groups, -1, 1), B[:, :, None, :])
    rows = seqs * groups  # one batch dimension for bmm (a view unless the slots are strided; then a copy)
    y = torch.bmm(C.reshape(rows, 1, d_state), grouped.reshape(rows, -1, d_state).transpose(1, 2))
    y = y.view(seqs, heads, head_dim)
    return y.addcmul_(D[:, None], x)
