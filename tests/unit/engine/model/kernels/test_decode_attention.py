"""The compiled decode attention against SDPA over the same buffers with the mask the plan builds: rows of different
lengths, windows (rows starting past column 0), one to three query heads per KV head, buffers wider and longer than
the step needs. float32 to float32 rounding; bfloat16 against SDPA in float32 on the same bfloat16 values, rounded
once (the kernel's arithmetic is float32 throughout), to one bfloat16 step. Then its refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridpd.engine.model.kernels.decode_attention import decode_attention
from hybridpd.engine.model.step.masks import additive, visible

TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.bfloat16: {"rtol": 2 ** -7, "atol": 1e-5}}


def _case(rows: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    capacity = 320
    k_buf, v_buf = (torch.randn(rows + 2, kv_heads, capacity, head_dim, generator=gen).to(dtype) for _ in range(2))
    # q | k | v per row, as the projection leaves them: the kernel reads the first heads * head_dim columns
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).mul_(2).to(dtype)
    return qkv, k_buf, v_buf


def _reference(qkv, k_buf, v_buf, positions, window, heads, kv_heads, head_dim, scale):
    """SDPA in float32 over the columns the rows need together, masked as DecodeKV's plan masks them."""
    rows = len(positions)
    p = torch.tensor(positions)
    start = 0 if window is None else max(0, min(positions) - window + 1)
    length = max(positions) + 1
    bias = additive(visible(p, torch.arange(start, length), window), torch.float32)[:, None, None, :]
    q = qkv[:, : heads * head_dim].float().view(rows, kv_heads, heads // kv_heads, head_dim)
    k, v = (b[:rows, :, start:length].float() for b in (k_buf, v_buf))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale).reshape(rows, heads * head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("positions, window", [
    ([0], None),                    # one key
    ([5, 300, 17, 2], None),        # lengths far apart; 300 past a multiple of four
    ([7, 8, 9, 10, 11], None),      # every remainder of four
    ([40, 299, 100], 16),           # windows: each row from its own first key on
    ([3, 50], 64),                  # a window wider than one row's keys
])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 32), (12, 4, 64), (2, 2, 16), (3, 1, 8), (6, 2, 24)])
@pytest.mark.parametrize("lanes", [8, 16])   # keys a block: AVX-512's 16 floats, or 8 (head size 24: a short chunk)
def test_kernel_matches_sdpa(positions, window, heads, kv_heads, head_dim, dtype, lanes):
    qkv, k_buf, v_buf = _case(len(positions), heads, kv_heads, head_dim, dtype, seed=sum(positions) + head_dim)
    p = torch.tensor(positions)
    first = torch.zeros_like(p) if window is None else (p - (window - 1)).clamp_(min=0)
    scale = head_dim ** -0.5
    got = decode_attention(qkv, k_buf, v_buf, first, p + 1, heads, scale, lanes=lanes)
    want = _reference(qkv, k_buf, v_buf, positions, window, heads, kv_heads, head_dim, scale).to(dtype)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("ends", [(10, 20), (40, 37), (32, 36)])   # within one block, whole blocks and a last one
def test_a_row_reads_only_its_own_keys(ends, lanes):
    """Keys outside a row's range (another row's, or past its end: NaN here) change nothing."""
    qkv, k_buf, v_buf = _case(2, 4, 2, 32, torch.float32, seed=3)
    first, end = torch.tensor([0, 4]), torch.tensor(ends)
    want = decode_attention(qkv, k_buf, v_buf, first, end, 4, 0.2, lanes=lanes)
    k_buf[0, :, ends[0]:], v_buf[0, :, ends[0]:] = float("nan"), float("nan")
    k_buf[1, :, :4], v_buf[1, :, ends[1]:] = float("nan"), float("nan")
    assert torch.equal(decode_attention(qkv, k_buf, v_buf, first, end, 4, 0.2, lanes=lanes), want)


@pytest.mark.parametrize("change, message", [
    (lambda c: {**c, "qkv": c["qkv"].half()}, "one dtype"),
    (lambda c: {**c, "v_buf": c["v_buf"].bfloat16()}, "one dtype"),
    (lambda c: {**c, "qkv": c["qkv"][:, ::2]}, "shapes"),               # not contiguous
    (lambda c: {**c, "num_heads": 3}, "shapes"),                         # not a multiple of the KV heads
    (lambda c: {**c, "end": c["end"][:1]}, "shapes"),
    (lambda c: {**c, "k_buf": c["k_buf"][:1]}, "shapes"),               # fewer buffer rows than rows
    (lambda c: {**c, "first": torch.tensor([0, 20])}, "within its buffer row"),   # no keys
    (lambda c: {**c, "end": torch.tensor([5, 321])}, "within its buffer row"),    # past the buffer
    (lambda c: {**c, "first": torch.tensor([-1, 0])}, "within its buffer row"),
    (lambda c: {**c, "lanes": 12}, "lanes"),
])
def test_refusals(change, message):
    qkv, k_buf, v_buf = _case(2, 4, 2, 32, torch.float32, seed=1)
    call = {"qkv": qkv, "k_buf": k_buf, "v_buf": v_buf, "first": torch.tensor([0, 0]), "end": torch.tensor([5, 20]),
            "num_heads": 4, "scale": 0.2}
    with pytest.raises(ValueError, match=message):
        decode_attention(**change(call))
