"""The prefill attention through oneDNN's products against a float64 reference (a masked softmax spelled out): rows
within one block and across several (the last one partial), after no keys and after many, one to three query heads
per KV head, both dtypes: float32 to float32 rounding, bfloat16 no
further from the reference than transformers' bfloat16 attention (the softmax's weights rounded to bfloat16 before the
values' product, as here) or torch's SDPA on the same bfloat16 values. Then its refusals, which calls it takes,
and an engine whose prefills all go through it against one whose prefills go through SDPA, step by step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridpd.engine.model.kernels import product_attention
from hybridpd.engine.model.kernels.packed import packing_works
from hybridpd.engine.model.kernels.product_attention import BLOCK, causal_attention

from tests.unit.engine.engine_harness import drive, greedy, make_recording_engine, prompt

pytestmark = pytest.mark.skipif(not packing_works(torch.float32), reason="this torch has no oneDNN products")
DTYPES = [torch.float32, torch.bfloat16]


def _reference(q, k, v, first, scale):
    """float64: row i over keys 0 .. first + i, by the definition (keys past the last row's never read)."""
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    k, v = k[: first + n], v[: first + n]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,mhd->hnm", q, k) * scale
    seen = torch.arange(k.shape[0])[None, :] <= first + torch.arange(n)[:, None]
    weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("hnm,mhd->nhd", weights, v)


def _eager_bf16(q, k, v, first, scale):
    """transformers' eager attention in bfloat16: the scores' softmax in float32, its weights rounded to bfloat16,
    their product with the values rounded to bfloat16."""
    n, heads, _ = q.shape
    group = heads // k.shape[1]
    k, v = k[: first + n].repeat_interleave(group, 1), v[: first + n].repeat_interleave(group, 1)
    scores = torch.einsum("nhd,mhd->hnm", q.float(), k.float()) * scale
    seen = torch.arange(k.shape[0])[None, :] <= first + torch.arange(n)[:, None]
    weights = scores.masked_fill(~seen, float("-inf")).softmax(-1).to(q.dtype)
    return torch.einsum("hnm,mhd->nhd", weights, v)


def _sdpa(q, k, v, first, scale):
    n, m = q.shape[0], k.shape[0]
    seen = torch.arange(m)[None, :] <= first + torch.arange(n)[:, None]
    bias = torch.zeros(n, m, dtype=q.dtype).masked_fill_(~seen, float("-inf"))
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=bias,
                                         scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, first, extra", [
    (1, 0, 0),                  # one row, one key
    (37, 0, 0),                 # a fresh prompt within a block
    (BLOCK, 0, 0),              # exactly one block
    (2 * BLOCK + 13, 0, 0),     # three blocks, the last partial
    (5, 300, 0),                # a few rows after many keys
    (BLOCK + 70, 91, 0),        # two blocks after a prefix
    (20, 44, 12),               # keys past the last row's (block padding): never read
])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 32), (12, 4, 64), (2, 2, 16), (3, 1, 8)])
def test_matches_the_definition(rows, first, extra, heads, kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(rows + first + head_dim)
    keys = first + rows + extra
    q = torch.randn(rows, heads, head_dim, generator=gen).mul_(2).to(dtype)
    k, v = (torch.randn(keys, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    if extra:   # padding the product must not read: NaN would spread through any row that did
        k[first + rows :], v[first + rows :] = float("nan"), float("nan")
    scale = head_dim ** -0.5
    out = torch.full((rows, heads, head_dim), float("nan"), dtype=dtype)
    causal_attention(q, k, v, out, first, scale)
    want = _reference(q, k, v, first, scale)
    error = (out.double() - want).abs().max().item()
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=4e-6)   # sums of up to ~800 terms
    else:
        others = (_sdpa(q, k[: first + rows], v[: first + rows], first, scale), _eager_bf16(q, k, v, first, scale))
        assert error <= 1.5 * max((o.double() - want).abs().max().item() for o in others) + 2 ** -10


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, first, block", [(100, 0, 64), (60, 196, BLOCK)])
def test_keys_a_row_does_not_see_never_set_its_scale(monkeypatch, rows, first, block, dtype):
    """Key j scoring 100 j: a row's softmax is its own last key's alone, and the keys after it in its block
    (scoring up to 100 x the block's rows higher) must neither set the row's highest (every weight it sees would
    underflow to 0) nor take any weight. Two blocks of 64 rows, and one after 196 keys (key ids up to 256: exact in
    bfloat16)."""
    monkeypatch.setattr(product_attention, "BLOCK", block)
    keys = first + rows
    q = torch.zeros(rows, 2, 8)
    q[:, :, 0] = 1.0
    k = torch.zeros(keys, 1, 8)
    k[:, 0, 0] = torch.arange(keys, dtype=torch.float32)
    v = torch.randn(keys, 1, 8, generator=torch.Generator().manual_seed(3))
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = torch.full((rows, 2, 8), float("nan"), dtype=dtype)
    causal_attention(q, k, v, out, first, 100.0)
    own = v[first : first + rows, 0]
    torch.testing.assert_close(out, own[:, None].expand(rows, 2, 8))


@pytest.mark.parametrize("scores_max", [1, 7 * 40, 2 * 33 * 40])
def test_fewer_rows_a_product_over_many_keys(monkeypatch, scores_max):
    """A block takes fewer rows when its scores would pass SCORES_MAX: one row at a time, seven, 33 (the last
    block's shorter), the same results."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(40, 4, 16, generator=gen)
    k, v = (torch.randn(40, 2, 16, generator=gen) for _ in range(2))
    whole = torch.empty(40, 4, 16)
    causal_attention(q, k, v, whole, 0, 0.25)
    monkeypatch.setattr(product_attention, "SCORES_MAX", scores_max)
    parts = torch.empty(40, 4, 16)
    causal_attention(q, k, v, parts, 0, 0.25)
    torch.testing.assert_close(parts, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(parts.double(), _reference(q, k, v, 0, 0.25), rtol=1e-5, atol=4e-6)


def test_several_kv_heads_write_only_their_own_query_heads():
    """Each KV head's query heads get that head's values (distinct constants per KV head)."""
    q = torch.randn(6, 4, 8)
    k = torch.randn(6, 2, 8)
    v = torch.stack([torch.full((6, 8), 1.0), torch.full((6, 8), -3.0)], dim=1)
    out = torch.empty(6, 4, 8)
    causal_attention(q, k, v, out, 0, 0.5)
    assert torch.allclose(out[:, :2], torch.tensor(1.0)) and torch.allclose(out[:, 2:], torch.tensor(-3.0))


@pytest.mark.parametrize("heads, kv_heads, rows, first, keys", [
    (3, 2, 4, 0, 4),      # query heads not a multiple of KV heads
    (4, 2, 4, 2, 5),      # the last row's key missing
    (4, 2, 4, -1, 4),     # a negative start
])
def test_refusals(heads, kv_heads, rows, first, keys):
    with pytest.raises(ValueError):
        causal_attention(torch.zeros(rows, heads, 8), torch.zeros(keys, kv_heads, 8), torch.zeros(keys, kv_heads, 8),
                         torch.zeros(rows, heads, 8), first, 1.0)


@pytest.mark.parametrize("pays, rows, keys, sequences, expected", [
    (True, 128, 256, 1, True),          # MIN_WORK exactly
    (True, 127, 256, 1, False),
    (True, 32, 1024, 1, True),          # a few rows after many keys
    (True, 256, 256, 8, False),         # several fresh prompts: BATCHED_MIN_WORK
    (True, 512, 512, 4, True),
    (True, 64, product_attention.MAX_KEYS + 1, 1, False),   # SDPA streams over many keys
    (False, 2048, 2048, 1, False),      # a CPU where SDPA's products are the faster
])
def test_which_calls_it_takes(monkeypatch, pays, rows, keys, sequences, expected):
    monkeypatch.setattr(product_attention, "products_pay", lambda dtype: pays)
    assert product_attention.takes(torch.float32, rows, keys, sequences) is expected


def test_an_engine_through_the_products_equals_one_through_sdpa(tiny_dir, monkeypatch):
    """Fresh prompts alone and several of one length, chunked prompts (rows after their own earlier chunks), and a
    prompt after a prefix-cache hit: every prefill of the tiny preset's full-attention layers through the products
    in one engine, through SDPA in the other (its window layers through SDPA in both)."""
    arrivals = {0: [greedy("alone", prompt(1, 61), 4)],
                2: [greedy(f"same{i}", prompt(10 + i, 24), 3) for i in range(3)],
                6: [greedy("chunked", prompt(3, 150), 4)],
                14: [greedy("prefix", prompt(3, 150)[:100] + prompt(4, 30), 4)]}   # a hit where a chunk ended
    results = []
    firsts: set[bool] = set()
    attend = product_attention.causal_attention

    def spy(q, k, v, out, first, scale):
        firsts.add(first > 0)
        attend(q, k, v, out, first, scale)

    monkeypatch.setattr(product_attention, "causal_attention", spy)
    for forced in (True, False):
        monkeypatch.setattr(product_attention, "takes", lambda *args, forced=forced: forced)
        engine, rows = make_recording_engine(tiny_dir, num_blocks=200, budget=64)
        outputs, cached = drive(engine, arrivals)
        assert cached["prefix"] > 0, cached
        results.append((outputs, rows))
    assert firsts == {True, False}   # fresh prompts and rows after earlier keys both went through it
    (outputs_on, rows_on), (outputs_off, rows_off) = results
    assert outputs_on == outputs_off and len(rows_on) == len(rows_off)
    for step, (on, off) in enumerate(zip(rows_on, rows_off)):
        assert on.keys() == off.keys(), step
        for rid in on:
            torch.testing.assert_close(on[rid], off[rid], atol=1e-5, rtol=0, msg=f"{rid} at step {step}")


@pytest.mark.parametrize("packs, dtype, expected", [
    ({torch.float32, torch.bfloat16}, torch.bfloat16, True),    # bfloat16 units, MKL's generic code
    ({torch.float32}, torch.bfloat16, False),                   # no bfloat16 units (an AVX2 EPYC): SDPA
    ({torch.float32}, torch.float32, True),
    ({torch.bfloat16}, torch.float32, False),                   # MKL's own float32 kernels (Intel's CPUs)
    (set(), torch.bfloat16, False),
])
def test_which_cpus_it_pays_on(monkeypatch, packs, dtype, expected):
    monkeypatch.setattr(product_attention, "packs_products", lambda d: d in packs)
    assert product_attention.products_pay(dtype) is expected
