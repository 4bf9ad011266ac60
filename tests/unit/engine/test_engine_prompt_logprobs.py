"""Prompt logprobs (vLLM's `prompt_logprobs`) through the engine on the tiny hybrid preset: each prompt position's
logprob, rank and top tokens equal what the model gives that position when the prefix before it is the whole
prompt of a request of its own (the brute-force reference: one request per position, its last row's logits read);
in one chunk or many, after a prefix the cache holds (computed again, not hit), after a preemption, and on a
decode node handed a remotely prefilled request (computed there, the prefill node's blocks let go). Every scenario
ends with every block free."""

from __future__ import annotations

import pytest
import torch

from hybridpd.engine.request import EngineRequest, TokenLogprob
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.transfer_params import RemotePrefillParams

from .engine_harness import all_free, greedy, make_engine, make_recording_engine, remote_params_for, run, token_ids
from .engine_harness import text_prompt
from .sched_harness import FakeLoader

PROMPT = text_prompt("The quick brown fox jumps over the lazy dog, twice")
TOP = 3


@pytest.fixture(scope="module")
def reference(tiny_dir) -> list[TokenLogprob]:
    """Position k's entry from a request whose prompt is PROMPT[:k], scored from its sampling row's logits."""
    engine, rows = make_recording_engine(tiny_dir, num_blocks=64, budget=2048)
    for k in range(1, len(PROMPT)):
        engine.add_request(greedy(f"p{k}", PROMPT[:k], max_tokens=1))
    run(engine)
    logits = {rid: row for step in rows for rid, row in step.items()}
    entries = []
    for k in range(1, len(PROMPT)):
        logprobs = torch.log_softmax(logits[f"p{k}"].double(), dim=-1)
        top = torch.topk(logprobs, TOP)
        token = PROMPT[k]
        entries.append(TokenLogprob(token_id=token, logprob=float(logprobs[token]),
                                    top=tuple(zip(top.indices.tolist(), top.values.tolist())),
                                    rank=int((logprobs > logprobs[token]).sum()) + 1))
    assert all_free(engine)
    return entries


def scoring(rid: str, ids: tuple[int, ...] = PROMPT, max_tokens: int = 3, **sampling) -> EngineRequest:
    return greedy(rid, ids, max_tokens=max_tokens, prompt_logprobs=TOP, **sampling)


def assert_match(got: tuple, expected: list[TokenLogprob]) -> None:
    assert got[0] is None and len(got) == len(expected) + 1
    for k, (entry, want) in enumerate(zip(got[1:], expected), start=1):
        assert entry.token_id == want.token_id == PROMPT[k]
        assert entry.logprob == pytest.approx(want.logprob, abs=1e-4), k
        assert entry.rank == want.rank, k
        assert [t for t, _ in entry.top] == [t for t, _ in want.top], k
        assert [v for _, v in entry.top] == pytest.approx([v for _, v in want.top], abs=1e-4), k


def first_outputs(engine) -> dict:
    outputs = run(engine)
    for rid, outs in outputs.items():
        assert all(o.prompt_logprobs is None for o in outs[1:]), f"{rid}: prompt logprobs come once, first"
    return outputs


@pytest.mark.parametrize("budget", [2048, 7, 16])
def test_prompt_logprobs_equal_each_position_scored_alone(tiny_dir, reference, budget):
    engine = make_engine(tiny_dir, budget=budget)
    engine.add_request(scoring("s"))
    engine.add_request(greedy("plain", PROMPT[:20], max_tokens=4))   # beside it, without them
    outputs = first_outputs(engine)
    assert_match(outputs["s"][0].prompt_logprobs, reference)
    assert outputs["plain"][0].prompt_logprobs is None
    assert all_free(engine)


def test_a_cached_prefix_is_computed_again_and_scored(tiny_dir, reference):
    engine = make_engine(tiny_dir)
    engine.add_request(greedy("warm", PROMPT, max_tokens=2))
    warm = token_ids(run(engine)["warm"])
    engine.add_request(scoring("s", max_tokens=2))
    outputs = first_outputs(engine)["s"]
    assert outputs[0].num_cached_tokens == 0
    assert_match(outputs[0].prompt_logprobs, reference)
    assert token_ids(outputs) == warm
    engine.add_request(greedy("after", PROMPT, max_tokens=2))   # the cache still serves the others
    assert run(engine)["after"][0].num_cached_tokens > 0
    assert all_free(engine)


def test_a_one_token_prompt_has_one_empty_entry(tiny_dir):
    engine = make_engine(tiny_dir)
    engine.add_request(scoring("s", PROMPT[:1]))
    assert first_outputs(engine)["s"][0].prompt_logprobs == (None,)
    assert all_free(engine)


def test_prompt_logprobs_survive_a_preemption(tiny_dir, reference):
    """Few blocks and a small budget: the scoring request is preempted mid-prompt and computed again."""
    engine = make_engine(tiny_dir, num_blocks=20, budget=8, max_num_seqs=4)
    engine.add_request(greedy("a", PROMPT, max_tokens=24))
    engine.add_request(scoring("s", max_tokens=2))
    preempted = []
    outputs: dict[str, list] = {}
    while engine.has_work():
        plan_preempted = engine.scheduler.running[:]   # who runs before the step
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        preempted += [seq.request_id for seq in plan_preempted if seq not in engine.scheduler.running
                      and not seq.is_finished]
        engine.kv.check_invariants()
    assert "s" in preempted, "the scenario must preempt the scoring request"
    assert_match(outputs["s"][0].prompt_logprobs, reference)
    assert all_free(engine)


def test_a_decode_node_computes_the_prompt_and_lets_the_prefill_node_go(tiny_dir, reference):
    engine = make_engine(tiny_dir)
    loader = FakeLoader()
    engine.set_remote(loader, hold_handler=lambda seq, logprob: {"held": seq.request_id},
                      decode_skip_mamba_align=True)
    params: RemotePrefillParams = remote_params_for(engine, len(PROMPT))
    first = engine.add_request(EngineRequest(request_id="r", prompt_token_ids=PROMPT, kv_transfer=params,
                                             sampling=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                                     prompt_logprobs=TOP)))
    assert first is None   # nothing streamed before its prompt is computed
    assert loader.released == [params.remote_request_id] and loader.started == []
    outputs = first_outputs(engine)["r"]
    assert_match(outputs[0].prompt_logprobs, reference)
    colocated = make_engine(tiny_dir)
    colocated.add_request(greedy("c", PROMPT, max_tokens=3))
    assert token_ids(outputs) == token_ids(run(colocated)["c"])
    assert all_free(engine)
