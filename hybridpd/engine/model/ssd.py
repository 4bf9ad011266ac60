"""Mamba2's chunked state-space-duality (SSD) scan for one sequence, and its one-token recurrent step.

The recurrence per head h (state S of shape [head_dim, d_state]):
    S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t B_t^T        y_t = S_t C_t
The chunked form splits time into chunks of `chunk_size`: inside a chunk the output is a masked
attention-like product (the "diagonal" term); across chunks only the states at chunk boundaries are carried.
Chunk boundaries are aligned to ABSOLUTE positions: the scan of tokens starting at position p is front-padded
with `p % chunk_size` tokens whose dt is 0 (decay exp(0) = 1, input 0), which leaves the state untouched, and
back-padded the same way. So the states at boundaries are exactly the states after a multiple of
`chunk_size` tokens of the sequence, whatever chunking of the prompt the scheduler chose.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ScanResult:
    y: torch.Tensor                # [n, heads, head_dim] float32 (without the D skip)
    boundary_states: torch.Tensor  # [chunks + 1, heads, head_dim, d_state]; [k] = state after k chunks
    first_boundary: int            # absolute token count of boundary_states[0] (a multiple of chunk_size)


def _pad_rows(t: torch.Tensor, front: int, back: int) -> torch.Tensor:
    pad = [0, 0] * (t.dim() - 1) + [front, back]
    return F.pad(t, pad)


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
    start: int,
    chunk_size: int,
) -> ScanResult:
    """x [n, H, P], dt [n, H] (after softplus/clamp), A [H] (negative), B/C [n, H, N] (already per head),
    initial_state [H, P, N]: the state after the sequence's first `start` tokens. All float32."""
    n = x.shape[0]
    front = start % chunk_size
    back = (-(front + n)) % chunk_size
    xdt = _pad_rows(x * dt[..., None], front, back)
    a = _pad_rows(dt * A[None, :], front, back)
    B = _pad_rows(B, front, back)
    C = _pad_rows(C, front, back)
    chunks = xdt.shape[0] // chunk_size
    heads, head_dim, d_state = initial_state.shape
    xdt = xdt.view(chunks, chunk_size, heads, head_dim)
    B = B.view(chunks, chunk_size, heads, d_state)
    C = C.view(chunks, chunk_size, heads, d_state)
    a = a.view(chunks, chunk_size, heads).permute(0, 2, 1)  # [c, H, l]
    a_cum = torch.cumsum(a, dim=-1)

    # Diagonal blocks: y[l] += sum_{s <= l} (C_l . B_s) exp(a[s+1..l]) xdt_s
    decay = torch.exp(_segment_sums(a))  # [c, H, l, s]
    scores = torch.einsum("clhn,cshn->chls", C, B) * decay
    y = torch.einsum("chls,cshp->clhp", scores, xdt)

    # Each chunk's own contribution to the state at its end.
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [c, H, l]
    chunk_states = torch.einsum("clhn,chl,clhp->chpn", B, to_end, xdt)

    # States at every boundary: boundary k = sum_j exp(total[j..k-1]) * contribution_j (j = 0 is the initial state).
    totals = F.pad(a_cum[..., -1].transpose(0, 1), (1, 0))  # [H, c + 1], totals[:, k] = decay of chunk k - 1
    carry = torch.exp(_segment_sums(totals))  # [H, c + 1, c + 1]
    contributions = torch.cat([initial_state[None], chunk_states], dim=0)  # [c + 1, H, P, N]
    boundary = torch.einsum("hkj,jhpn->khpn", carry, contributions)

    # Off-diagonal: the state entering chunk c, decayed to each position and read out by C.
    y = y + torch.einsum("clhn,chpn,chl->clhp", C, boundary[:-1], torch.exp(a_cum))
    y = y.reshape(chunks * chunk_size, heads, head_dim)[front : front + n]
    return ScanResult(y=y, boundary_states=boundary, first_boundary=start - front)


def recurrent_step_(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> torch.Tensor:
    """Batched single step, updating `state` in place. state [S, H, P, N], x [S, H, P], dt [S, H], A [H],
    B/C [S, H, N] -> y [S, H, P]."""
    decay = torch.exp(dt * A[None, :])[..., None, None]
    state.mul_(decay).add_((dt[..., None] * x)[..., None] * B[:, :, None, :])
    return torch.matmul(state, C[..., None])[..., 0]
