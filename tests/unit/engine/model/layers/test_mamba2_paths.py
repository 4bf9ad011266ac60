"""Mamba layers on float32 states (in either model dtype) run the compiled kernel (fused_mamba.py); caches of other
dtypes the torch path (batched recurrent step, chunked scan). Both paths on the same float32 model and the same
requests: the same greedy tokens and the same logits to float32 rounding, through chunked prefills, mixed steps,
decode-only steps, preemption, and prefix hits that restore saved Mamba states (which only exist if the saves were
written right); with in_proj as one product and as two (the gate apart, as the kernel path takes a prefill's rows).
A bfloat16 model takes the kernel too, and agrees with the torch path to bfloat16 rounding."""

from __future__ import annotations

import pytest
import torch

from hybridpd.engine.kv_cache.spec import MambaSpec
from hybridpd.engine.model.step import mamba_meta
from hybridpd.engine.model.layers.mamba2 import Mamba2Mixer

from tests.oracle.saved_models import FALCON_H1_VARIANTS, save_falcon_h1
from tests.unit.engine.engine_harness import all_free, drive, greedy, make_recording_engine, prompt


SHARED = prompt(1, 40)
SCENARIOS = {
    # chunked prefills (budget 16) beside decoding rows; a later request resumes from a saved prefix state
    "chunked_mixed_and_hit": (16, 400, {0: [greedy("a", SHARED, 10), greedy("b", prompt(2, 23), 6)],
                                        14: [greedy("c", SHARED[:36] + prompt(3, 7), 6)]}),
    # one long batched prefill, then decode-only steps; arrivals join mid-decode
    "batched_then_decode": (512, 400, {0: [greedy(f"p{i}", prompt(10 + i, 9 + 5 * i), 12) for i in range(3)],
                                       5: [greedy("late", prompt(20, 3), 5)]}),
    # too few blocks: requests are preempted and recomputed
    "preempted": (512, 14, {0: [greedy(f"p{i}", prompt(30 + i, 14 + 3 * i), 16) for i in range(3)]}),
}


@pytest.mark.parametrize("gate_apart_from", [None, 8], ids=["default", "gate_apart_from_8_rows"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_kernel_and_torch_paths_agree(tiny_dir, scenario, gate_apart_from, monkeypatch):
    budget, num_blocks, arrivals = SCENARIOS[scenario]
    if gate_apart_from is not None:  # the tiny prompts' steps then take in_proj as two products, as a prefill does
        monkeypatch.setattr(Mamba2Mixer, "SEPARATE_GATE_FROM_ROWS", gate_apart_from)
    fused, fused_rows = make_recording_engine(tiny_dir, num_blocks=num_blocks, budget=budget)
    fused_out, fused_cached = drive(fused, arrivals)
    monkeypatch.setattr(mamba_meta, "fused_mamba", lambda spec: False)
    torch_path, torch_rows = make_recording_engine(tiny_dir, num_blocks=num_blocks, budget=budget)
    torch_out, torch_cached = drive(torch_path, arrivals)

    assert fused_out == torch_out
    assert fused_cached == torch_cached
    if scenario == "chunked_mixed_and_hit":
        assert fused_cached["c"] > 0  # the hit restored a Mamba state the kernel saved
    assert len(fused_rows) == len(torch_rows)
    for a, b in zip(fused_rows, torch_rows):
        assert a.keys() == b.keys()
        for rid in a:
            torch.testing.assert_close(a[rid], b[rid], rtol=1e-4, atol=1e-4)
    assert all_free(fused) and all_free(torch_path)


@pytest.fixture(scope="module", params=sorted(FALCON_H1_VARIANTS))
def falcon_dir(request, tmp_path_factory):
    """Falcon-H1 in each way Mamba's output meets its gate (shapes.MambaNorm), with in_proj's μP multipliers."""
    return save_falcon_h1(tmp_path_factory.mktemp(request.param), request.param)[0]


def test_kernel_and_torch_paths_agree_for_every_gate_norm(falcon_dir, monkeypatch):
    budget, num_blocks, arrivals = SCENARIOS["chunked_mixed_and_hit"]
    fused, fused_rows = make_recording_engine(falcon_dir, num_blocks=num_blocks, budget=budget)
    fused_out, fused_cached = drive(fused, arrivals)
    monkeypatch.setattr(mamba_meta, "fused_mamba", lambda spec: False)
    torch_path, torch_rows = make_recording_engine(falcon_dir, num_blocks=num_blocks, budget=budget)
    torch_out, torch_cached = drive(torch_path, arrivals)
    assert fused_out == torch_out and fused_cached == torch_cached and fused_cached["c"] > 0
    for a, b in zip(fused_rows, torch_rows, strict=True):
        for rid in a:
            torch.testing.assert_close(a[rid], b[rid], rtol=1e-4, atol=1e-4)
    assert all_free(fused) and all_free(torch_path)


def test_a_bfloat16_model_runs_the_kernel_on_float32_states(tiny_dir, monkeypatch):
    """Prefills only (one token each: no near-tied greedy token can send the two down different paths), chunked
    beside each other, and a hit on the Mamba state a chunk saved: the kernel's logits against the torch path's."""
    arrivals = {0: [greedy("a", SHARED, 1), greedy("b", prompt(2, 23), 1)],
                6: [greedy("c", SHARED[:36] + prompt(3, 7), 1)]}
    fused, fused_rows = make_recording_engine(tiny_dir, num_blocks=400, budget=16, dtype="bfloat16")
    mamba_specs = [g.spec for g in fused.groups if isinstance(g.spec, MambaSpec)]
    assert mamba_specs and all(spec.dtypes == (torch.float32, torch.float32) for spec in mamba_specs)
    assert all(mamba_meta.fused_mamba(spec) for spec in mamba_specs)
    fused_out, fused_cached = drive(fused, arrivals)
    monkeypatch.setattr(mamba_meta, "fused_mamba", lambda spec: False)
    torch_path, torch_rows = make_recording_engine(tiny_dir, num_blocks=400, budget=16, dtype="bfloat16")
    torch_out, torch_cached = drive(torch_path, arrivals)
    assert fused_cached == torch_cached and fused_cached["c"] > 0
    assert len(fused_rows) == len(torch_rows)
    for a, b in zip(fused_rows, torch_rows):
        for rid in a:
            assert a[rid].dtype == torch.float32 and a[rid].abs().max() > 1.0
            torch.testing.assert_close(a[rid], b[rid], rtol=0.0, atol=0.15)   # measured: up to 0.06 on logits of ~3
    assert all_free(fused) and all_free(torch_path)
