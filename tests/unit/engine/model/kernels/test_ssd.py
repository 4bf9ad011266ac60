"""The chunked scan and the recurrent step against the plain token-by-token recurrence.

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T        y_t = S_t C_t + D x_t
Inputs are strided views (columns of one wider tensor, as the mixer passes them), B and C per group.
"""

from __future__ import annotations

import pytest
import torch

from hybridpd.engine.model.kernels.ssd import chunked_scan, recurrent_step_


def _inputs(seqs: int, length: int, heads: int, head_dim: int, groups: int, d_state: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    width = heads * head_dim + 2 * groups * d_state
    conv = torch.randn(seqs, length, width + 3, generator=generator)  # + 3: the views below are strided
    x = conv[..., : heads * head_dim].unflatten(-1, (heads, head_dim))
    B = conv[..., heads * head_dim : width - groups * d_state].unflatten(-1, (groups, d_state))
    C = conv[..., width - groups * d_state : width].unflatten(-1, (groups, d_state))
    dt = (torch.rand(seqs, length, heads + 2, generator=generator) * 0.5)[..., :heads]
    A = -(torch.rand(heads, generator=generator) * 7 + 1)
    D = torch.randn(heads, generator=generator)
    initial = torch.randn(seqs, heads, head_dim, d_state, generator=generator)
    return x, dt, A, B, C, D, initial


def _reference(x, dt, A, B, C, D, initial):
    """Token by token: y [S, L, H, P] and the state after every token [S, L + 1, H, P, N] ([0] = initial)."""
    heads = x.shape[2]
    per_group = heads // B.shape[2]
    B = B.repeat_interleave(per_group, dim=2)
    C = C.repeat_interleave(per_group, dim=2)
    state = initial.double().clone()
    states, ys = [state.clone()], []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t].double() * A.double())[..., None, None]
        state = decay * state + (dt[:, t].double()[..., None] * x[:, t].double())[..., None] * B[:, t].double()[:, :, None]
        ys.append((state * C[:, t].double()[:, :, None]).sum(-1) + D.double()[:, None] * x[:, t].double())
        states.append(state.clone())
    return torch.stack(ys, 1), torch.stack(states, 1)


@pytest.mark.parametrize(
    "seqs, length, heads, head_dim, groups, d_state, chunk",
    [
        (1, 8, 4, 32, 2, 16, 8),      # one sequence, one chunk
        (3, 24, 4, 32, 2, 16, 8),     # groups > 1
        (2, 64, 4, 8, 4, 8, 16),      # one head per group
        (4, 64, 4, 16, 1, 8, 32),     # one group for all heads (the default preset's shape)
        (2, 12, 2, 4, 1, 4, 3),       # odd sizes
        (5, 32, 6, 4, 3, 4, 4),
    ],
)
def test_chunked_scan_matches_recurrence(seqs, length, heads, head_dim, groups, d_state, chunk):
    x, dt, A, B, C, D, initial = _inputs(seqs, length, heads, head_dim, groups, d_state, seed=length * heads)
    y, boundary = chunked_scan(x, dt, A, B, C, D, initial, chunk)
    expected_y, states = _reference(x, dt, A, B, C, D, initial)
    assert y.shape == x.shape and y.is_contiguous()
    torch.testing.assert_close(y.double(), expected_y, rtol=1e-4, atol=1e-4)
    assert boundary.shape == (length // chunk + 1, seqs, heads, head_dim, d_state)  # chunk-major
    torch.testing.assert_close(boundary.double(), states[:, ::chunk].transpose(0, 1), rtol=1e-4, atol=1e-4)


def test_chunked_scan_writes_into_out_and_padding_keeps_the_state():
    """dt = 0 and x = 0 on a row's last chunk (padding): its last boundary repeats the one before."""
    x, dt, A, B, C, D, initial = _inputs(2, 16, 4, 8, 2, 4, seed=7)
    x, dt = x.clone(), dt.clone()
    x[1, 8:] = 0
    dt[1, 8:] = 0
    out = torch.empty(2, 16, 4, 8)
    y, boundary = chunked_scan(x, dt, A, B, C, D, initial, 8, out)
    assert y.data_ptr() == out.data_ptr()
    assert torch.equal(boundary[2, 1], boundary[1, 1])
    torch.testing.assert_close(y.double(), _reference(x, dt, A, B, C, D, initial)[0], rtol=1e-4, atol=1e-4)


def test_chunked_scan_large_decays_stay_finite():
    """Decays far below exp(-88) inside a chunk: no inf/nan from the masked upper triangle."""
    x, dt, A, B, C, D, initial = _inputs(2, 32, 4, 8, 1, 4, seed=3)
    dt = dt * 100
    y, boundary = chunked_scan(x, dt, A, B, C, D, initial, 16)
    assert torch.isfinite(y).all() and torch.isfinite(boundary).all()
    torch.testing.assert_close(y.double(), _reference(x, dt, A, B, C, D, initial)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "seqs, heads, head_dim, groups, d_state, slot_step",
    [(1, 4, 32, 1, 16, 1), (16, 4, 64, 1, 32, 1), (3, 4, 32, 2, 16, 1), (5, 6, 4, 3, 8, 2), (2, 4, 8, 4, 8, 3)],
)
def test_recurrent_step_matches_recurrence(seqs, heads, head_dim, groups, d_state, slot_step):
    """One token; the states are a strided view of a larger cache (slots in a progression) and update in place."""
    x, dt, A, B, C, D, initial = _inputs(seqs, 1, heads, head_dim, groups, d_state, seed=seqs * heads + slot_step)
    cache = torch.zeros(seqs * slot_step + 1, heads, head_dim, d_state)
    state = cache[1 :: slot_step][:seqs]
    state.copy_(initial)
    y = recurrent_step_(state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D)
    expected_y, states = _reference(x, dt, A, B, C, D, initial)
    torch.testing.assert_close(y.double(), expected_y[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache[1 :: slot_step][:seqs].double(), states[:, 1], rtol=1e-5, atol=1e-5)
