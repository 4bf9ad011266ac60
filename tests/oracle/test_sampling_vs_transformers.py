"""Logits processors through the whole engine against transformers' `generate` with its own processors, on a
checkpoint transformers wrote (`save_pretrained`; its cached decode is what `generate` runs): repetition_penalty (the same definition in both), and min_tokens beside a logit_bias that makes EOS the
likeliest token (transformers' `min_new_tokens` and `sequence_bias`). Greedy, so the tokens must be identical."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from hybridpd.engine.request import EngineRequest, FinishReason
from hybridpd.engine.sampling_params import SamplingParams
from tests.oracle.saved_models import save_granite
from tests.oracle.reference import reference_logits
from tests.oracle.test_engine_vs_transformers import Recorder, assert_drained, make_engine, prompt


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    torch.set_num_threads(1)
    return save_granite(tmp_path_factory.mktemp("granite-dense"), "dense")


def engine_outputs(model_dir, requests: dict[str, tuple[int, ...]], params: SamplingParams):
    engine = make_engine(model_dir, Recorder())
    for rid, ids in requests.items():
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=ids, sampling=params))
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    reasons = {}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        engine.kv.check_invariants()
    assert_drained(engine)
    return engine, tokens, reasons


def generate(reference, ids: tuple[int, ...], **config) -> list[int]:
    """transformers' greedy `generate`; the attention mask given, or it would take the prompt's zeros for padding."""
    out = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             generation_config=GenerationConfig(do_sample=False, pad_token_id=0, **config))
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("penalty", [1.6, 0.7])
def test_repetition_penalty_matches_transformers(granite, penalty):
    model_dir, reference = granite
    requests = {"a": prompt(1, 9), "b": prompt(2, 23)}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=penalty)
    _, tokens, _ = engine_outputs(model_dir, requests, params)
    plain = engine_outputs(model_dir, requests, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[1]
    assert tokens != plain, "the penalty changed nothing: the test would not see it ignored"
    for rid, ids in requests.items():
        expected = generate(reference, ids, max_new_tokens=12, eos_token_id=None, repetition_penalty=penalty)
        assert tokens[rid] == expected, rid


@pytest.mark.parametrize("min_tokens", [0, 3])
def test_min_tokens_holds_eos_back_as_transformers_does(granite, min_tokens):
    model_dir, reference = granite
    requests = {"a": prompt(3, 11), "b": prompt(4, 17)}
    engine = make_engine(model_dir, Recorder())
    eos_ids = sorted(engine.eos_token_ids)     # every id that ends a request; min_tokens holds them all back
    eos = eos_ids[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=min_tokens, logit_bias=((eos, 40.0),))
    _, tokens, reasons = engine_outputs(model_dir, requests, params)
    for rid, ids in requests.items():
        expected = generate(reference, ids, max_new_tokens=8, eos_token_id=eos_ids, min_new_tokens=min_tokens,
                            sequence_bias={(eos,): 40.0})
        assert tokens[rid] == expected and len(expected) == min_tokens + 1 and expected[-1] == eos, rid
        assert reasons[rid] is FinishReason.STOP


@pytest.mark.parametrize("budget", [2048, 12])
def test_prompt_logprobs_match_transformers(granite, budget):
    """Every prompt position's logprob, rank and top tokens against a full transformers forward's log-softmax, the
    prompt in one chunk or in several (its Mamba state carried from chunk to chunk)."""
    model_dir, reference = granite
    ids = prompt(5, 37)
    engine = make_engine(model_dir, Recorder(), budget=budget)
    engine.add_request(EngineRequest(request_id="s", prompt_token_ids=ids,
                                     sampling=SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=4)))
    first = _first_output(engine)
    while engine.has_work():
        engine.step()
    assert_drained(engine)
    logprobs = torch.log_softmax(reference_logits(reference, list(ids)).double(), dim=-1)
    got = first.prompt_logprobs
    assert got[0] is None and len(got) == len(ids)
    for k in range(1, len(ids)):
        row, entry = logprobs[k - 1], got[k]
        assert entry.token_id == ids[k]
        assert entry.logprob == pytest.approx(float(row[ids[k]]), abs=1e-4), k
        assert entry.rank == int((row > row[ids[k]]).sum()) + 1, k
        top = torch.topk(row, 4)
        assert [t for t, _ in entry.top] == top.indices.tolist(), k
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4), k


def _first_output(engine):
    for _ in range(100):
        outputs = [out for out in engine.step() if out.request_id == "s"]
        if outputs:
            return outputs[0]
    raise AssertionError("the engine made no progress")
