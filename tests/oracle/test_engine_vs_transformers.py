"""The whole engine (scheduler + KV cache + runner) vs transformers on the same checkpoint.

At every step, each logits row the engine samples from must be within 1e-4 of the reference's logits at that
position of the final sequence, and greedy tokens must be identical. Scenarios: one request, 8 concurrent
requests of different lengths (also with every projection of a few rows through the few-rows kernel), one batched
prefill step of 627 rows, chunked prefill under a small token budget, a request that hits the prefix cache in every
group kind, preempted-and-resumed requests, and groups that trade one tight memory budget back and forth.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from hybridpd.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridpd.engine.engine import LLMEngine
from hybridpd.engine.kv_cache.storage import KVCacheStorage
from hybridpd.engine.model.kernels import linear as linear_module
from hybridpd.engine.model.kernels.packed import packing_works
from hybridpd.presets.checkpoints import write_checkpoint
from hybridpd.engine.request import EngineRequest
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.scheduler import SchedulerPlan
from tests.oracle.reference import load_reference, reference_logits

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    model_dir = write_checkpoint("tiny", tmp_path_factory.mktemp("tiny"))
    return model_dir, load_reference(model_dir)


@dataclass
class Recorder:
    """Every sampled logits row: (request id, position whose logits these are, row)."""

    rows: list[tuple[str, int, torch.Tensor]] = field(default_factory=list)

    def __call__(self, plan: SchedulerPlan, logits: torch.Tensor) -> None:
        samplers = [item for item in plan.scheduled if item.samples]
        for item, row in zip(samplers, logits):
            position = item.seq.num_computed_tokens + item.num_new_tokens - 1
            self.rows.append((item.seq.request_id, position, row.clone()))


def make_engine(model_dir, recorder, *, num_blocks=64, budget=2048, block_size=4, max_num_seqs=16,
                offload_dir=None, mamba_cache_interval=None) -> LLMEngine:
    config = EngineConfig(
        model_dir=model_dir,
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_offload_dir=offload_dir,
                          mamba_cache_interval=mamba_cache_interval),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
    )
    return LLMEngine(config, logits_hook=recorder)


def prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def run(engine: LLMEngine, requests: dict[str, tuple[int, ...]], max_tokens: int) -> dict[str, list[int]]:
    for rid, ids in requests.items():
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=ids,
                                         sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                 ignore_eos=True)))
    outputs: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        engine.kv.check_invariants()
    return outputs


def check_against_reference(reference, requests, outputs, recorder: Recorder) -> None:
    full = {rid: list(ids) + outputs[rid] for rid, ids in requests.items()}
    expected = {rid: reference_logits(reference, seq) for rid, seq in full.items()}
    assert recorder.rows, "the engine sampled nothing"
    for rid, position, row in recorder.rows:
        ref = expected[rid][position]
        err = (row - ref).abs().max().item()
        assert err < TOL, f"{rid} position {position}: max |logits - reference| = {err:.2e}"
        # the token sampled from this row is the next token of the final sequence
        assert full[rid][position + 1] == int(torch.argmax(row)), f"{rid} position {position}"
        assert full[rid][position + 1] == int(torch.argmax(ref)), f"{rid} position {position}: greedy differs"


def assert_drained(engine: LLMEngine) -> None:
    engine.kv.check_invariants()
    for stats in engine.kv.stats():
        assert stats.num_free == stats.num_total, f"group {stats.group_id} leaked blocks"


def test_one_request(tiny):
    model_dir, reference = tiny
    recorder = Recorder()
    engine = make_engine(model_dir, recorder)
    requests = {"a": prompt(1, 29)}
    outputs = run(engine, requests, max_tokens=12)
    check_against_reference(reference, requests, outputs, recorder)
    assert_drained(engine)


@pytest.mark.parametrize("kernel", [None, "few_rows_linear", pytest.param("one_row_linear", marks=pytest.mark.skipif(
    not packing_works(torch.float32), reason="this torch build packs no float32 weights"))])
def test_eight_concurrent_requests_of_different_lengths(tiny, monkeypatch, kernel):
    """With a `kernel`, every projection it is for goes through it (on the tiny preset's weights, which are below the
    sizes the kernels are used for): the few-rows kernel takes 2-8 rows where float32 does not pack, the one-row
    kernel one row where it does (the rest then through the packed products)."""
    calls = []
    if kernel is not None:
        monkeypatch.setattr(linear_module, "FEW_ROWS_MIN_WEIGHT", 0)
        monkeypatch.setattr(linear_module, "FEW_ROWS_MIN_INTEL", 2)
        monkeypatch.setattr(linear_module, "ONE_ROW_MIN_WEIGHT", 0)
        monkeypatch.setattr(linear_module, "ONE_ROW_MIN_WEIGHT_BF16", 0)
        monkeypatch.setattr(linear_module, "_f32_packing", kernel == "one_row_linear")
        monkeypatch.setattr(linear_module, "_f32_own_loops", kernel == "one_row_linear")
        original = getattr(linear_module, kernel)
        monkeypatch.setattr(linear_module, kernel, lambda *a: calls.append(1) or original(*a))
    model_dir, reference = tiny
    recorder = Recorder()
    engine = make_engine(model_dir, recorder)
    requests = {f"r{i}": prompt(10 + i, 3 + 7 * i) for i in range(8)}
    outputs = run(engine, requests, max_tokens=6)
    check_against_reference(reference, requests, outputs, recorder)
    assert_drained(engine)
    assert bool(calls) is (kernel is not None)


def test_one_large_batched_prefill_step(tiny):
    """Three prompts of 200+ tokens prefilled together in one step of 627 rows."""
    model_dir, reference = tiny
    recorder = Recorder()
    engine = make_engine(model_dir, recorder, num_blocks=3 * 60)
    requests = {f"big{i}": prompt(30 + i, 200 + 9 * i) for i in range(3)}
    outputs = run(engine, requests, max_tokens=4)
    check_against_reference(reference, requests, outputs, recorder)
    assert_drained(engine)


def test_a_long_prompt_in_large_chunks(tiny):
    """Chunks of 128 rows: where MKL runs generic code, oneDNN's products (kernels/product_attention.py) take the
    full attention of the second (128 rows after 128 earlier keys) and of none of the others."""
    model_dir, reference = tiny
    recorder = Recorder()
    engine = make_engine(model_dir, recorder, budget=128, num_blocks=100)
    requests = {"long": prompt(2, 300)}
    outputs = run(engine, requests, max_tokens=5)
    check_against_reference(reference, requests, outputs, recorder)
    assert_drained(engine)


def test_chunked_prefill_under_a_small_token_budget(tiny):
    model_dir, reference = tiny
    recorder = Recorder()
    engine = make_engine(model_dir, recorder, budget=7)
    requests = {"long": prompt(3, 61), "short": prompt(4, 9)}
    outputs = run(engine, requests, max_tokens=5)
    check_against_reference(reference, requests, outputs, recorder)
    assert_drained(engine)


# The default interval (8: the checkpoint's scan chunk) and one that is not a multiple of it: the kernel holds a state
# after every token, so a hit at 36 tokens is as exact as one at 40.
@pytest.mark.parametrize("interval, mamba_hit", [(None, 40), (12, 36)])
def test_prefix_hit_in_every_group_kind(tiny, interval, mamba_hit):
    model_dir, reference = tiny
    recorder = Recorder()
    engine = make_engine(model_dir, recorder, mamba_cache_interval=interval)
    shared = prompt(5, 40)
    first = {"first": shared + prompt(6, 5)}
    run(engine, first, max_tokens=3)
    second = {"second": shared + prompt(7, 9)}
    recorder.rows.clear()
    outputs = run(engine, second, max_tokens=6)
    hits = {s.kind: s.hit_tokens for s in engine.kv.stats()}
    assert set(hits) == {"mamba", "full_attention", "sliding_window"}
    assert all(h > 0 for h in hits.values()), hits
    assert hits["mamba"] == mamba_hit
    check_against_reference(reference, second, outputs, recorder)
    assert_drained(engine)


def test_preempted_requests_resume_correctly(tiny):
    model_dir, reference = tiny
    recorder = Recorder()
    engine = make_engine(model_dir, recorder, num_blocks=14)
    requests = {f"p{i}": prompt(20 + i, 14 + 3 * i) for i in range(3)}
    preempted: set[str] = set()
    original = engine.scheduler._preempt

    def spy(seq):
        preempted.add(seq.request_id)
        original(seq)

    engine.scheduler._preempt = spy
    outputs = run(engine, requests, max_tokens=16)
    assert preempted, "the scenario must preempt at least one request"
    check_against_reference(reference, requests, outputs, recorder)
    assert_drained(engine)


def test_groups_that_share_a_tight_budget_trade_blocks_both_ways_and_stay_exact(tiny, monkeypatch):
    """180 KB for the tiny model's groups (a Mamba slot is 21 KB, a token of attention 0.75 KB): admissions take
    Mamba slots from cached attention blocks, and growing prompts take attention blocks from Mamba slots."""
    model_dir, reference = tiny
    released: list[tuple[int, int]] = []
    original = KVCacheStorage.release

    def spy(storage: KVCacheStorage, group: int, block: int) -> None:
        released.append((group, block))
        original(storage, group, block)

    monkeypatch.setattr(KVCacheStorage, "release", spy)
    recorder = Recorder()
    config = EngineConfig(
        model_dir=model_dir,
        cache=CacheConfig(block_size=4, kv_cache_memory=180_000),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16, max_model_len=128),
    )
    engine = LLMEngine(config, logits_hook=recorder)
    shared = prompt(40, 24)
    requests = {f"s{i}": shared + prompt(41 + i, 4 + 5 * i) for i in range(6)}
    outputs = run(engine, requests, max_tokens=16)
    check_against_reference(reference, requests, outputs, recorder)
    kinds = {engine.groups[g].spec.kind for g, _ in released}
    assert "mamba" in kinds and kinds & {"full_attention", "sliding_window"}, kinds
    assert_drained(engine)
