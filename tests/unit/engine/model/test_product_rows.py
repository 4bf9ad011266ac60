"""`PagedCausalLM.product_rows`: the rows a step's projections multiply, which the scheduler fills with prompt tokens
while requests decode (its prefill cap is raised to them)."""

from __future__ import annotations

import pytest

from hybridpd.engine.model import paged_lm
from hybridpd.engine.model.kernels.packed import bucketed_rows

from tests.unit.engine.engine_harness import make_engine


@pytest.mark.parametrize("packs", [True, False])
@pytest.mark.parametrize("rows", [1, 12, 20, 200, 208, 300])
def test_the_rows_a_step_takes_where_products_pack(monkeypatch, tiny_dir, packs, rows):
    engine = make_engine(tiny_dir)
    model = engine.model
    monkeypatch.setattr(paged_lm, "packs_products", lambda dtype: packs)
    assert model.product_rows(rows) == (bucketed_rows(rows) if packs else rows)
    assert engine.scheduler.step_rows == model.product_rows
