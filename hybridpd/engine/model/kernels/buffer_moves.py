"""A step's held decode rows moved up in the DecodeKV buffers (step/decode_kv.py) in one compiled call a layer.

When sequences before it leave, a row that holds its keys moves up to its new row: keys and values, each KV head's
first `held` positions. Two torch copies a move and layer cost ~5-10 us each in indexing alone (profiled: 5.4% of a
served small-vllm bfloat16 256 / 64 workload at 16 in flight, where a request leaves every few steps and the rows
after it move); here all of a layer's moves are one call. Any element type: the bits are copied.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from hybridpd.engine.model.kernels.bf16_bits import KERNEL_DTYPES, held_array

_I64_1D = numba.int64[::1]


@numba.njit([numba.void(element[:, :, :, ::1], element[:, :, :, ::1], _I64_1D, _I64_1D, _I64_1D)
             for element in (numba.float32, numba.uint16)], cache=True, nogil=True, boundscheck=False)
def _move_rows(k_buf, v_buf, sources, targets, keys):  # pragma: no cover - compiled
    rows, capacity = k_buf.shape[0], k_buf.shape[2]
    for m in range(sources.shape[0]):
        s, t, n = sources[m], targets[m], keys[m]
        if not (0 <= t < rows and 0 <= s < rows and 0 <= n <= capacity):
            raise ValueError("move_rows_: a move outside the buffers")
        for h in range(k_buf.shape[1]):
            k_buf[t, h, :n] = k_buf[s, h, :n]
            v_buf[t, h, :n] = v_buf[s, h, :n]


def move_rows_(k_buf: torch.Tensor, v_buf: torch.Tensor, sources: np.ndarray, targets: np.ndarray,
               keys: np.ndarray) -> None:
    """In order, move m: row `targets[m]` of both buffers ([rows, KV heads, capacity, head_dim], contiguous, float32
    or bfloat16) gets the first `keys[m]` positions of row `sources[m]` (int64 arrays of one length)."""
    if (k_buf.shape != v_buf.shape or k_buf.dtype != v_buf.dtype or k_buf.dtype not in KERNEL_DTYPES
            or not (k_buf.is_contiguous() and v_buf.is_contiguous())):
        raise ValueError(f"move_rows_: two contiguous buffers of one shape and dtype, got {tuple(k_buf.shape)} "
                         f"{k_buf.dtype} and {tuple(v_buf.shape)} {v_buf.dtype}")
    _move_rows(held_array(k_buf), held_array(v_buf), sources, targets, keys)
