"""The engine with vLLM's further sampling fields on the tiny preset: stop_token_ids end a request (stop_reason the
id, its text left out), min_tokens holds EOS and stop tokens back, and both hold on a prefill node and a decode node
of a P/D pair. Every scenario ends with every block free."""

from __future__ import annotations

import pytest

from hybridpd.engine.request import EngineRequest, FinishReason
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.transfer_params import RemoteDecodeParams

from .engine_harness import (all_free, finished_text, decode_node, decode_remotely, greedy, make_engine, remote_params_for, run,
                             text, text_prompt, token_ids)
from .sched_harness import FakeLoader

PROMPT = text_prompt("The quick brown fox jumps over")


@pytest.fixture
def plain(tiny_dir):
    """The greedy ids of PROMPT with nothing but max_tokens."""
    engine = make_engine(tiny_dir)
    engine.add_request(greedy("ref", PROMPT, max_tokens=16))
    return token_ids(run(engine)["ref"])


def first_new(ids: list[int]) -> int:
    """A position whose token does not occur before it (past the first two)."""
    return next(k for k in range(2, len(ids)) if ids[k] not in ids[:k])


def test_a_stop_token_id_ends_the_request_without_its_text(tiny_dir, plain):
    k = first_new(plain)
    engine = make_engine(tiny_dir)
    engine.add_request(greedy("s", PROMPT, max_tokens=16, stop_token_ids=(plain[k],)))
    outputs = run(engine)["s"]
    assert token_ids(outputs) == plain[:k + 1]
    assert outputs[-1].finish_reason is FinishReason.STOP and outputs[-1].stop_reason == plain[k]
    assert text(outputs) == finished_text(engine.tokenizer, plain[:k])
    assert all_free(engine)


def test_min_tokens_holds_a_stop_token_id_back(tiny_dir, plain):
    k = first_new(plain)
    engine = make_engine(tiny_dir)
    engine.add_request(greedy("s", PROMPT, max_tokens=16, stop_token_ids=(plain[k],), min_tokens=k + 1))
    ids = token_ids(run(engine)["s"])
    assert ids[:k] == plain[:k] and ids[k] != plain[k]   # masked at position k, the greedy choice moves
    assert plain[k] not in ids[:k + 1] and len(ids) > k + 1
    assert all_free(engine)


def eos_first(engine, **sampling) -> SamplingParams:
    """Greedy with EOS made the likeliest token by far."""
    eos = min(engine.eos_token_ids)
    return SamplingParams(**({"max_tokens": 8} | sampling), temperature=0.0, logit_bias=((eos, 100.0),))


@pytest.mark.parametrize("min_tokens", [0, 1, 3])
def test_min_tokens_holds_eos_back(tiny_dir, min_tokens):
    engine = make_engine(tiny_dir)
    engine.add_request(EngineRequest(request_id="e", prompt_token_ids=PROMPT,
                                     sampling=eos_first(engine, min_tokens=min_tokens)))
    outputs = run(engine)["e"]
    ids = token_ids(outputs)
    assert len(ids) == min_tokens + 1 and ids[-1] in engine.eos_token_ids
    assert not engine.eos_token_ids & set(ids[:-1])
    assert outputs[-1].finish_reason is FinishReason.STOP and outputs[-1].stop_reason is None
    assert text(outputs) == finished_text(engine.tokenizer, ids[:-1])
    assert all_free(engine)


def test_a_prefill_node_draws_its_first_token_under_min_tokens(tiny_dir):
    """The proxy sends max_tokens 1; min_tokens comes cut to it (sampling_fields.py): EOS may not be the first."""
    engine = make_engine(tiny_dir)
    held = []
    engine.set_remote(FakeLoader(), hold_handler=lambda seq, logprob: held.append(seq) or {"held": True},
                      decode_skip_mamba_align=True)
    engine.add_request(EngineRequest(request_id="p", prompt_token_ids=PROMPT, kv_transfer=RemoteDecodeParams(),
                                     sampling=eos_first(engine, min_tokens=1, max_tokens=1)))
    out, = run(engine)["p"]
    assert out.finish_reason is FinishReason.LENGTH and out.new_token_ids[0] not in engine.eos_token_ids
    assert out.kv_transfer_params == {"held": True}
    engine.kv.free("p")
    assert all_free(engine)


def test_a_decode_node_ends_at_once_when_the_first_token_is_a_stop_token(tiny_dir):
    engine, loader = decode_node(tiny_dir)
    request = EngineRequest(request_id="d", prompt_token_ids=PROMPT[:20],
                            sampling=SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(7,)),
                            kv_transfer=remote_params_for(engine, 20, first_token_id=7))
    first = engine.add_request(request)
    assert first.finished and first.finish_reason is FinishReason.STOP and first.stop_reason == 7
    assert first.new_token_ids == (7,) and first.new_text == ""
    assert run(engine) == {} and not loader.started
    assert all_free(engine)


def test_a_decode_node_counts_the_first_token_toward_min_tokens(tiny_dir):
    """A remotely prefilled request starts with one output token: with min_tokens 2, the next token may not stop it,
    the one after may."""
    engine, loader = decode_node(tiny_dir)
    eos = min(engine.eos_token_ids)
    request = EngineRequest(request_id="d", prompt_token_ids=PROMPT[:20],
                            sampling=SamplingParams(max_tokens=6, temperature=0.0, min_tokens=2,
                                                    logit_bias=((eos, 100.0),)),
                            kv_transfer=remote_params_for(engine, 20, first_token_id=5))
    outputs = decode_remotely(engine, loader, request)
    ids = token_ids(outputs)
    assert ids[0] == 5 and ids[1] != eos and ids[2] == eos and len(ids) == 3
    assert outputs[-1].finish_reason is FinishReason.STOP
    assert all_free(engine)
