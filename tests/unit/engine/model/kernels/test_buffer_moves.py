"""The DecodeKV buffers' row moves in one compiled call against the torch copies they replace: moves in ascending
order (a later move's source may be an earlier one's target's neighbour, never a row already overwritten), held
lengths from none to the whole capacity, both dtypes, each KV head's positions past the held ones left as they
were. Then its refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridpd.engine.model.kernels.buffer_moves import move_rows_


def _by_torch(k_buf, v_buf, moves):
    for source, target, held in moves:
        k_buf[target, :, :held] = k_buf[source, :, :held]
        v_buf[target, :, :held] = v_buf[source, :, :held]


def _arrays(moves):
    return tuple(np.array([m[i] for m in moves], dtype=np.int64) for i in range(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moves", [
    [],
    [(1, 0, 5)],                            # one row up
    [(2, 0, 7), (3, 1, 64), (5, 2, 0)],     # several, one holding nothing, one the whole capacity
    [(1, 0, 3), (2, 1, 9), (3, 2, 1), (4, 3, 33)],   # every row one up: each source is the next move's target's
])
def test_matches_the_torch_copies(moves, dtype):
    gen = torch.Generator().manual_seed(len(moves))
    k_buf, v_buf = (torch.randn(6, 2, 64, 8, generator=gen).to(dtype) for _ in range(2))
    want_k, want_v = k_buf.clone(), v_buf.clone()
    _by_torch(want_k, want_v, moves)
    move_rows_(k_buf, v_buf, *_arrays(moves))
    assert torch.equal(k_buf, want_k) and torch.equal(v_buf, want_v)


@pytest.mark.parametrize("moves, k_shape, dtype, message", [
    ([(6, 0, 3)], (6, 2, 64, 8), torch.float32, "outside the buffers"),    # no such source row
    ([(1, 0, 65)], (6, 2, 64, 8), torch.float32, "outside the buffers"),   # more keys than the capacity
    ([(1, 0, 3)], (6, 2, 64, 4), torch.float32, "one shape"),
    ([(1, 0, 3)], (6, 2, 64, 8), torch.float16, "one shape and dtype"),
])
def test_refusals(moves, k_shape, dtype, message):
    k_buf, v_buf = torch.zeros(k_shape, dtype=dtype), torch.zeros(6, 2, 64, 8, dtype=dtype)
    with pytest.raises(ValueError, match=message):
        move_rows_(k_buf, v_buf, *_arrays(moves))
