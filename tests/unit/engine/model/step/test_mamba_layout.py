"""`aligned` layouts are exactly those whose gathers are the identity (the mixer then skips them)."""

import pytest
import torch

from hybridpd.engine.model.step.mamba_layout import PrefillSeq, build_prefill_layout

CHUNK, WIDTH = 8, 3


def seqs_of(rows_and_computed, slot0=1):
    out, row = [], 0
    for i, (n, computed) in enumerate(rows_and_computed):
        out.append(PrefillSeq(row_start=row, num_rows=n, num_computed=computed, slot=slot0 + i, saves=()))
        row += n
    return out


@pytest.mark.parametrize(
    "rows_and_computed, extra_rows, aligned",
    [
        ([(16, 0)], 0, True),
        ([(16, 0), (16, 0), (16, 0)], 0, True),
        ([(16, 8), (16, 0)], 0, True),    # resumed on a chunk boundary
        ([(16, 0), (8, 0)], 0, False),    # unequal lengths
        ([(12, 0)], 0, False),            # not a whole number of chunks
        ([(16, 4)], 0, False),            # starts inside a chunk
        ([(16, 0)], 1, False),            # the step has other (decode) rows too
    ],
)
def test_aligned_iff_identity(rows_and_computed, extra_rows, aligned):
    seqs = seqs_of(rows_and_computed)
    total = sum(n for n, _ in rows_and_computed) + extra_rows
    lay = build_prefill_layout(seqs, total, CHUNK, WIDTH)
    assert lay.aligned is aligned
    if aligned:
        flat = torch.arange(total)
        assert torch.equal(lay.scan_index.flatten(), flat)
        assert torch.equal(lay.dt_index.flatten(), flat)
        assert torch.equal(lay.out_index, flat)
        assert torch.equal(lay.out_rows, flat)
