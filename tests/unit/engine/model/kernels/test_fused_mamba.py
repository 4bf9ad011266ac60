"""The compiled Mamba2 kernel against the formulas evaluated plainly in float64, token by token.

Shapes as the mixer has them: the caches are views into wider storage rows (slots strided, each slot contiguous),
slots in any order, one or several groups, with and without a conv bias, a dt limit or not; sequences of one row
(decode) and of many (prefill chunks), resumed from their slot or starting from zeros over a stale slot, states
saved to other slots after given rows; the SSM state kept in float32 or in bfloat16 (a bfloat16 model's: computed in
float32, rounded once where it is stored), and in_proj's xbc | dt_raw handed over in float32 or, as a bfloat16 model's
mixer hands them, in bfloat16 (read as its bits).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch.nn.functional as F

import numpy as np

from hybridpd.engine.model.kernels.fused_mamba import MambaKernelCaches, MambaKernelWeights, mamba_rows_
from hybridpd.engine.model.step.mamba_meta import MambaRows


def _reference(proj, conv_state, ssm_state, conv_w, conv_b, dt_bias, A, D, limit, norm_w, norm_group, eps, groups):
    """One row: returns (out, new conv state, new ssm state), all float64."""
    heads, head_dim, d_state = ssm_state.shape
    inner = heads * head_dim
    conv_dim = conv_w.shape[1]
    gate, new, dt_raw = proj[:inner], proj[inner : inner + conv_dim], proj[inner + conv_dim :]
    window = torch.cat([conv_state, new[None]])  # [width, C]
    conv = F.silu((window * conv_w).sum(0) + conv_b)
    x = conv[:inner].view(heads, head_dim)
    B = conv[inner : inner + groups * d_state].view(groups, d_state)
    C = conv[inner + groups * d_state :].view(groups, d_state)
    dt = F.softplus(dt_raw + dt_bias).clamp(*limit)
    state = ssm_state.clone()
    y = torch.empty(heads, head_dim, dtype=torch.float64)
    for h in range(heads):
        g = h // (heads // groups)
        state[h] = math.exp(dt[h] * A[h]) * state[h] + dt[h] * x[h][:, None] * B[g][None, :]
        y[h] = state[h] @ C[g] + D[h] * x[h]
    gated = (y.flatten() * F.silu(gate)).view(-1, norm_group)
    normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + eps)
    return normed.flatten() * norm_w, window[1:], state


def _ints(values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


CASES = [
    # heads, head_dim, groups, d_state, width, bias, limit, sequences: (rows, resumed, slot, saves after rows)
    (4, 64, 1, 32, 4, True, (0.0, math.inf), [(1, 1, 1, ()), (1, 1, 3, ()), (1, 1, 5, (1,)), (1, 1, 7, ())]),
    (4, 16, 2, 8, 4, False, (0.0, math.inf), [(5, 0, 6, (2, 5)), (1, 1, 0, ()), (9, 1, 2, (4,)),
                                              (37, 0, 8, (11, 16, 19))]),  # saves inside and at the ends of blocks
    (8, 8, 4, 16, 2, True, (0.01, 0.5), [(3, 0, 3, ())]),
    (2, 32, 1, 16, 3, True, (0.0, math.inf), [(1, 1, 4, ()), (2, 0, 5, (1, 2)), (40, 1, 1, (32,)), (1, 1, 0, ())]),
]
SAVE_SLOTS = (9, 10, 11, 12, 13, 1)  # slot 1: no sequence of the one case with six saves uses it


# (in_proj's xbc | dt_raw, the SSM state): a float32 model's, a bfloat16 state beside float32 projections, a bfloat16
# model's
DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("proj_dtype, ssm_dtype", DTYPES, ids=["f32", "ssm_bf16", "bf16"])
@pytest.mark.parametrize("heads, head_dim, groups, d_state, width, with_bias, limit, seqs", CASES)
def test_kernel_matches_the_formulas(heads, head_dim, groups, d_state, width, with_bias, limit, seqs, proj_dtype,
                                     ssm_dtype):
    _check_against_the_formulas(heads, head_dim, groups, d_state, width, with_bias, limit, seqs, ssm_dtype, proj_dtype)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_chunk_length_and_saves_match_the_formulas(data):
    """A prefill chunk of any length, from zeros or resumed, its states saved after any rows: the scan goes four rows
    at a time within a block of rows unless a save falls among them, so every alignment of saves, blocks and chunk
    ends must give the states the formulas give."""
    n = data.draw(st.integers(2, 45), label="rows")
    afters = data.draw(st.lists(st.integers(1, n), max_size=len(SAVE_SLOTS) - 1, unique=True), label="saves")
    resumed = data.draw(st.integers(0, 1), label="resumed")
    proj_dtype, ssm_dtype = data.draw(st.sampled_from(DTYPES), label="dtypes")
    _check_against_the_formulas(2, 8, 1, 8, 4, True, (0.0, math.inf), [(n, resumed, 3, tuple(sorted(afters)))],
                                ssm_dtype, proj_dtype)


def _check_against_the_formulas(heads, head_dim, groups, d_state, width, with_bias, limit, seqs, ssm_dtype,
                                proj_dtype=torch.float32):
    gen = torch.Generator().manual_seed(heads * 1000 + head_dim + len(seqs))
    inner = heads * head_dim
    conv_dim = inner + 2 * groups * d_state
    norm_group = inner // groups
    num_slots = 14
    # Storage rows wider than one slot's state, as in KVCacheStorage: slots strided, each one contiguous.
    conv_rows = torch.randn(num_slots, (width - 1) * conv_dim + 5, generator=gen)
    ssm_rows = torch.randn(num_slots, inner * d_state + 7, generator=gen).to(ssm_dtype)
    conv_cache = conv_rows[:, : (width - 1) * conv_dim].view(num_slots, width - 1, conv_dim)
    ssm_cache = ssm_rows[:, : inner * d_state].view(num_slots, heads, head_dim, d_state)
    total_rows = sum(n for n, *_ in seqs)
    # values a bfloat16 model's projection can hold (the formulas then take the same values)
    proj = torch.randn(total_rows, inner + conv_dim + heads, generator=gen).to(proj_dtype).float()
    conv_w = torch.randn(width, conv_dim, generator=gen) * 0.5
    conv_b = torch.randn(conv_dim, generator=gen) * 0.1 if with_bias else torch.zeros(conv_dim)
    dt_bias, D = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen)
    A = -torch.rand(heads, generator=gen) * 4 - 0.1
    norm_w = torch.randn(inner, generator=gen)
    eps = 1e-5
    starts = [sum(n for n, *_ in seqs[:q]) for q in range(len(seqs))]
    saves = [(q, after) for q, (_, _, _, afters) in enumerate(seqs) for after in afters]
    rows = MambaRows(
        starts=_ints(starts), lengths=_ints([n for n, *_ in seqs]),
        resumed=_ints([r for _, r, _, _ in seqs]), slots=_ints([s for _, _, s, _ in seqs]),
        save_seqs=_ints([q for q, _ in saves]), save_after=_ints([a for _, a in saves]),
        save_slots=_ints(list(SAVE_SLOTS[: len(saves)])),
    )
    before_conv, before_ssm = conv_cache.clone(), ssm_cache.clone()
    before_rows = conv_rows.clone(), ssm_rows.clone()
    touched = {s for _, _, s, _ in seqs} | set(SAVE_SLOTS[: len(saves)])

    weights = MambaKernelWeights.of(conv_w, conv_b, dt_bias, A, D, limit, norm_w, norm_group, eps, groups)
    # in_proj's whole output as the mixer hands it over, in the model's dtype
    out = mamba_rows_(proj.to(proj_dtype), rows, MambaKernelCaches.of(conv_cache, ssm_cache), weights)

    assert out.dtype == proj_dtype   # a bfloat16 model's output rounded where the kernel stores it
    tolerance = 1e-4 if proj_dtype == torch.float32 else 2 ** -8   # then one bfloat16 rounding more
    saved = {}
    for q, (n, resumed, slot, afters) in enumerate(seqs):
        conv_state = before_conv[slot].double() if resumed else torch.zeros(width - 1, conv_dim, dtype=torch.float64)
        ssm_state = before_ssm[slot].double() if resumed else torch.zeros(heads, head_dim, d_state, dtype=torch.float64)
        for t in range(n):
            want_out, conv_state, ssm_state = _reference(
                proj[starts[q] + t].double(), conv_state, ssm_state, conv_w.double(), conv_b.double(),
                dt_bias.double(), A.double(), D.double(), limit, norm_w.double(), norm_group, eps, groups,
            )
            torch.testing.assert_close(out[starts[q] + t].double(), want_out, rtol=tolerance, atol=tolerance)
            if t + 1 in afters:
                saved[SAVE_SLOTS[saves.index((q, t + 1))]] = conv_state, ssm_state
        saved[slot] = conv_state, ssm_state
    for slot, (want_conv, want_ssm) in saved.items():
        torch.testing.assert_close(conv_cache[slot].double(), want_conv)  # exact: stored inputs
        stored = want_ssm.to(ssm_dtype).double()   # rounded once, where it is stored
        # The kernel's float32 state and the float64 reference may round to neighbouring bfloat16 values: one unit
        # in the last place apart, up to 2^-7 of the value (bfloat16 keeps 8 significant bits).
        rtol = 1e-4 if ssm_dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(ssm_cache[slot].double(), stored, rtol=rtol, atol=1e-4)
    untouched = [s for s in range(num_slots) if s not in touched]
    assert torch.equal(conv_cache[untouched], before_conv[untouched])
    assert torch.equal(ssm_cache[untouched], before_ssm[untouched])
    # Nothing outside the slots' own states is written (the storage rows' other columns).
    assert torch.equal(conv_rows[:, (width - 1) * conv_dim :], before_rows[0][:, (width - 1) * conv_dim :])
    assert torch.equal(ssm_rows[:, inner * d_state :], before_rows[1][:, inner * d_state :])


def test_refuses_a_slot_that_is_not_contiguous():
    ssm_cache = torch.zeros(4, 2, 8, 3).transpose(2, 3)
    conv_cache = torch.zeros(4, 3, 2 * 8 + 2 * 3)
    with pytest.raises(ValueError, match="contiguous"):
        MambaKernelCaches.of(conv_cache, ssm_cache)


def _one_row_layer():
    """A 1-head layer's caches, weights and a decode row's layout (shapes only matter here)."""
    heads, head_dim, d_state, width = 1, 4, 2, 2
    inner = heads * head_dim
    conv_dim = inner + 2 * d_state
    conv_cache = torch.zeros(2, width - 1, conv_dim)
    ssm_cache = torch.zeros(2, heads, head_dim, d_state)
    weights = MambaKernelWeights.of(torch.ones(width, conv_dim), torch.zeros(conv_dim), torch.zeros(heads),
                                    -torch.ones(heads), torch.ones(heads), (0.0, math.inf), torch.ones(inner), inner,
                                    1e-5, 1)
    rows = MambaRows(starts=_ints([0]), lengths=_ints([1]), resumed=_ints([1]), slots=_ints([1]),
                     save_seqs=_ints([]), save_after=_ints([]), save_slots=_ints([]))
    return inner, conv_dim + heads, MambaKernelCaches.of(conv_cache, ssm_cache), weights, rows


@pytest.mark.parametrize("case, message", [
    ("a_column_short", "the layer's rows are"),
    ("xbc_dt_only", "the layer's rows are"),
    ("strided", "must be contiguous"),
])
def test_refuses_rows_it_cannot_read(case, message):
    """The kernel reads in_proj's whole output, gate | xbc | dt_raw, contiguous: anything else is refused before a
    row is read (it reads unchecked)."""
    inner, rest, caches, weights, rows = _one_row_layer()
    proj = {
        "a_column_short": torch.randn(2, inner + rest - 1),
        "xbc_dt_only": torch.randn(2, rest),
        "strided": torch.randn(inner + rest, 2).t(),
    }[case]
    with pytest.raises(ValueError, match=message):
        mamba_rows_(proj, rows, caches, weights)
