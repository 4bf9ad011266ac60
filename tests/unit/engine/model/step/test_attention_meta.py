"""Attention step metadata and RoPE against the straightforward formulas they replace.

- fresh runs attend in query chunks: the chunks together must give exactly the causal/band mask, and chunked
  attention the same numbers as one call over all keys;
- the decode bias and block list, built with tensor ops, against a per-row loop over key positions, and the
  decode-only step's metadata (layouts shared between groups) against the general path;
- RoPE applied in place on a strided view against transformers' `x * cos + rotate_half(x) * sin`.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from hybridpd.engine.model.step.forward_batch import ForwardBatch, SeqEntry, int64_tensor
from hybridpd.engine.model.layers.rotary import RotaryEmbedding
from hybridpd.engine.model.step.attention_meta import _attention_decode, _attention_meta, _decode_only_meta, _query_chunks


def reference_visible(queries: range, keys: range, window: int | None) -> torch.Tensor:
    return torch.tensor([[k <= q and (window is None or k > q - window) for k in keys] for q in queries])


@pytest.mark.parametrize("n", [1, 5, 31, 32, 33, 64, 100, 256, 600])
@pytest.mark.parametrize("window", [None, 1, 5, 64, 160])
def test_query_chunks_give_the_mask(n, window):
    chunks = _query_chunks(n, window, torch.float32)
    assembled = torch.zeros(n, n, dtype=torch.bool)
    assert [c.q_start for c in chunks] == [0] + [c.q_end for c in chunks[:-1]] and chunks[-1].q_end == n
    for c in chunks:
        assert 0 <= c.k_start <= c.q_start < c.q_end
        if c.bias is None:  # is_causal: top-left aligned, so only right from key 0 and query 0
            assert c.q_start == c.k_start == 0
            visible = torch.ones(c.q_end, c.q_end, dtype=torch.bool).tril()
        else:
            assert c.bias.shape == (c.q_end - c.q_start, c.q_end - c.k_start)
            assert set(c.bias.unique().tolist()) <= {0.0, -math.inf}
            visible = c.bias == 0
            assert visible.any(dim=1).all()  # no query row without a key (softmax of all -inf)
        assembled[c.q_start : c.q_end, c.k_start : c.q_end] = visible
    assert torch.equal(assembled, reference_visible(range(n), range(n), window))


@pytest.mark.parametrize("num_seqs, n, window", [(1, 1, None), (1, 40, 5), (3, 100, None), (2, 70, 64), (2, 33, 1)])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_chunked_attention_equals_one_call(num_seqs, n, window, kv_heads):
    heads, head_dim = 4, 8
    g = torch.Generator().manual_seed(n)
    q = torch.randn(num_seqs, heads, n, head_dim, generator=g)
    k, v = (torch.randn(num_seqs, kv_heads, n, head_dim, generator=g) for _ in range(2))
    expected = F.scaled_dot_product_attention(
        q, k, v, attn_mask=reference_visible(range(n), range(n), window), enable_gqa=True
    )
    got = torch.empty_like(expected)
    for c in _query_chunks(n, window, torch.float32):
        got[:, :, c.q_start : c.q_end] = F.scaled_dot_product_attention(
            q[:, :, c.q_start : c.q_end], k[:, :, c.k_start : c.q_end], v[:, :, c.k_start : c.q_end],
            attn_mask=c.bias, is_causal=c.bias is None, enable_gqa=True,
        )
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("positions", [[0], [5], [15, 16, 17], [3, 40, 0, 31, 32], [100, 7]])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 1, 3, 5, 64])
def test_decode_blocks_and_bias(positions, block_size, window):
    """Row s reads nb blocks from the first one its window needs; key l of the row is the token at position
    first_block * block_size + l of the sequence, visible iff inside (position - window, position]."""
    tables = [[1000 * (s + 1) + b for b in range(p // block_size + 1)] for s, p in enumerate(positions)]
    seqs = [SeqEntry(num_computed=p, num_new=1, block_tables=(t,)) for p, t in zip(positions, tables)]
    rows = list(range(len(seqs)))
    d = _attention_decode(rows, seqs, 0, block_size, window, torch.float32)

    firsts = [0 if window is None else max(0, p - window + 1) // block_size for p in positions]
    nb = max(p // block_size - f for p, f in zip(positions, firsts)) + 1
    assert d.blocks.shape == (len(seqs) * nb,) and d.bias.shape == (len(seqs), 1, 1, nb * block_size)
    assert d.rows.tolist() == rows
    for s, (p, first, table) in enumerate(zip(positions, firsts, tables)):
        blocks = d.blocks[s * nb : (s + 1) * nb].tolist()
        for j, block in enumerate(blocks):
            assert block == table[min(first + j, p // block_size)]
        for key in range(nb * block_size):
            position = first * block_size + key
            visible = position <= p and (window is None or position > p - window)
            assert d.bias[s, 0, 0, key].item() == (0.0 if visible else -math.inf), (s, key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, heads, head_dim", [(1, 1, 2), (7, 6, 32), (16, 3, 8)])
def test_rope_in_place_on_a_strided_view(dtype, rows, heads, head_dim):
    rope = RotaryEmbedding(head_dim, 10000.0)
    positions = torch.arange(rows) * 37 % 500
    cos, sin = rope.cos_sin(positions, dtype, 500)
    g = torch.Generator().manual_seed(rows)
    fused = torch.randn(rows, heads * head_dim + 5, generator=g).to(dtype)  # extra columns: a strided view
    x = fused[:, : heads * head_dim].view(rows, heads, head_dim)
    untouched = fused[:, heads * head_dim :].clone()

    freqs = positions.float()[:, None] * rope.inv_freq[None, :]
    plain_cos = torch.cat((freqs, freqs), dim=-1).cos().to(dtype)[:, None, :]
    plain_sin = torch.cat((freqs, freqs), dim=-1).sin().to(dtype)[:, None, :]
    half = head_dim // 2
    rotate_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    expected = x * plain_cos + rotate_half * plain_sin

    RotaryEmbedding.apply_(x, cos, sin)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(x, expected, atol=tol, rtol=tol)
    assert torch.equal(fused[:, heads * head_dim :], untouched)


def test_rope_tables_grow_past_their_first_size_and_match_the_formula():
    rope = RotaryEmbedding(8, 10000.0)
    for positions in (torch.tensor([0, 3, 1023]), torch.tensor([1024, 5000, 7]), torch.tensor([2, 1])):
        cos, sin = rope.cos_sin(positions, torch.float32, int(positions.max()) + 1)
        freqs = positions.float()[:, None] * rope.inv_freq[None, :]
        torch.testing.assert_close(cos[:, 0], torch.cat((freqs, freqs), dim=-1).cos(), atol=1e-6, rtol=0)
        torch.testing.assert_close(sin[:, 0], torch.cat((-freqs.sin(), freqs.sin()), dim=-1), atol=1e-6, rtol=0)
    assert rope._tables[torch.float32][0].shape[0] == 8192  # grown once, to the power of two past 5000


@pytest.mark.parametrize("positions", [[0], [15, 16, 17], [3, 40, 0, 31, 32], [100, 7]])
@pytest.mark.parametrize("block_size, window", [(1, None), (4, None), (4, 3), (16, 64), (16, 5)])
def test_decode_only_metadata_equals_the_general_path(positions, block_size, window):
    tables = [[1000 * (s + 1) + b for b in range(p // block_size + 1)] for s, p in enumerate(positions)]
    seqs = tuple(SeqEntry(num_computed=p, num_new=1, block_tables=(t, t[::-1])) for p, t in zip(positions, tables))
    batch = ForwardBatch(input_ids=int64_tensor([7] * len(seqs)), positions=int64_tensor(positions), seqs=seqs,
                         logits_indices=int64_tensor(range(len(seqs))))
    assert batch.all_decode
    shared = {}
    for g in (0, 1):  # the second group reuses the first one's layout
        fast = _decode_only_meta(batch, g, block_size, window, torch.float32, shared)
        general = _attention_meta(batch, g, block_size, window, torch.float32)
        assert len(shared) == 1
        for name in ("write_blocks", "write_offsets"):
            assert torch.equal(getattr(fast, name), getattr(general, name)), name
        for name in ("rows", "blocks", "bias"):
            assert torch.equal(getattr(fast.decode, name), getattr(general.decode, name)), name
        assert fast.prefills == general.prefills == () and fast.fresh == general.fresh == ()
