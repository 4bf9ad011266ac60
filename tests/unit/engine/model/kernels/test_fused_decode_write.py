"""The compiled RoPE + paged write + buffer append of a decode step against the torch operations it replaces
(`RotaryEmbedding.apply_`, an advanced-index write into the paged cache, two into the DecodeKV buffers), on a cache
that is a strided view of wider storage rows, rows in blocks in any order, one or several query heads per KV head.
In float32 to float32 rounding; in bfloat16 against the rotation computed in float32 from the bfloat16 values and
rounded once (torch's bfloat16 operations round after each of them), to one bfloat16 step."""

from __future__ import annotations

import pytest
import torch

from hybridpd.engine.model.kernels.fused_decode_write import rope_and_write_, rope_and_write_paged_
from hybridpd.engine.model.layers.rotary import RotaryEmbedding

TOLERANCE = {torch.float32: {"rtol": 1e-6, "atol": 1e-6}, torch.bfloat16: {"rtol": 2 ** -7, "atol": 1e-5}}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])


def _rotated(qkv: torch.Tensor, rotated_heads: int, head_dim: int, cos: torch.Tensor,
             sin: torch.Tensor) -> torch.Tensor:
    """The reference: `RotaryEmbedding.apply_` in float32 on the values as stored, rounded once to their dtype."""
    wide = qkv.float()
    rows = qkv.shape[0]
    RotaryEmbedding.apply_(wide[:, : rotated_heads * head_dim].view(rows, -1, head_dim), cos.float(), sin.float())
    return wide.to(qkv.dtype)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[got.dtype])


@DTYPES
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(4, 2, 32, 16), (4, 1, 32, 16), (2, 2, 8, 4),
                                                                   (6, 3, 16, 8)])
def test_kernel_matches_the_torch_operations(heads, kv_heads, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + head_dim)
    rows, num_blocks = 5, 40
    positions = torch.tensor([0, 7, 33, 300, 129])
    blocks = torch.randperm(num_blocks, generator=gen)[:rows]
    offsets = positions % block_size
    cos, sin = RotaryEmbedding(head_dim, 10000.0).cos_sin(positions, dtype, 512)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    block = 2 * block_size * kv_heads * head_dim
    storage = torch.randn(num_blocks, block + 9, generator=gen).to(dtype)  # rows wider than a block: blocks strided
    storages = [storage.clone(), storage.clone()]
    caches = [s[:, :block].view(num_blocks, 2, block_size, kv_heads, head_dim) for s in storages]
    buffers = [[torch.zeros(rows + 1, kv_heads, 320, head_dim, dtype=dtype) for _ in range(2)] for _ in range(2)]
    qkvs = [qkv.clone(), qkv.clone()]

    rope_and_write_(qkvs[0], cos, sin, heads, caches[0], blocks, offsets, *buffers[0], positions)

    qkvs[1] = _rotated(qkvs[1], heads + kv_heads, head_dim, cos, sin)
    k_and_v = qkvs[1][:, heads * head_dim :].view(rows, 2, kv_heads, head_dim)
    caches[1][blocks, :, offsets] = k_and_v
    buffers[1][0][torch.arange(rows), :, positions] = k_and_v[:, 0]
    buffers[1][1][torch.arange(rows), :, positions] = k_and_v[:, 1]

    _close(qkvs[0], qkvs[1])
    _close(storages[0], storages[1])  # padding columns untouched too
    for got, want in zip(buffers[0], buffers[1]):
        _close(got, want)


@DTYPES
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(4, 2, 32, 16), (4, 1, 32, 16), (6, 3, 16, 8)])
def test_paged_kernel_matches_the_torch_operations(heads, kv_heads, head_dim, block_size, dtype):
    """A prefill's rows: consecutive positions of two sequences, filling blocks in their order, no buffers."""
    gen = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + head_dim + 1)
    positions = torch.cat([torch.arange(0, 37), torch.arange(100, 131)])
    num_blocks = 60
    order = torch.randperm(num_blocks, generator=gen)
    tables = [order[:20], order[20:40]]   # the two sequences' block tables (long enough for block size 8)
    blocks = torch.cat([tables[0][positions[:37] // block_size], tables[1][positions[37:] // block_size]])
    offsets = positions % block_size
    rows = positions.shape[0]
    cos, sin = RotaryEmbedding(head_dim, 10000.0).cos_sin(positions, dtype, 512)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    block = 2 * block_size * kv_heads * head_dim
    storage = torch.randn(num_blocks, block + 9, generator=gen).to(dtype)
    storages = [storage.clone(), storage.clone()]
    caches = [s[:, :block].view(num_blocks, 2, block_size, kv_heads, head_dim) for s in storages]
    qkvs = [qkv.clone(), qkv.clone()]

    rope_and_write_paged_(qkvs[0], cos, sin, heads, caches[0], blocks, offsets)

    qkvs[1] = _rotated(qkvs[1], heads + kv_heads, head_dim, cos, sin)
    caches[1][blocks, :, offsets] = qkvs[1][:, heads * head_dim :].view(rows, 2, kv_heads, head_dim)

    _close(qkvs[0], qkvs[1])
    _close(storages[0], storages[1])
