"""Structured outputs in the engine on the tiny preset (a BPE vocabulary of 320 tokens): every token drawn is one the
constraint allows, against a brute-force reference over a finite language (greedy: the likeliest allowed token of the
model's own logits); JSON schemas give JSON that follows them; a decode node's matcher takes the first token its
prefill node drew. Every scenario ends with every block free."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from hybridpd.engine.grammar import Grammar, GrammarCompiler, grammar_vocabulary
from hybridpd.engine.output_constraint import ConstraintKind, OutputConstraint
from hybridpd.engine.request import EngineRequest, FinishReason
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.transfer_params import RemoteDecodeParams
from hybridpd.errors import InvalidRequestError

from .engine_harness import (all_free, decode_node, decode_remotely, greedy, make_engine, make_recording_engine,
                             remote_params_for, run, text, text_prompt, token_ids)
from .sched_harness import FakeLoader

PROMPT = text_prompt("The quick brown fox jumps over")
CHOICES = ["apple pie", "banana", "cherry tart", "ab", "a"]
REGEX = r"(ab|cd)[0-3]x?"
REGEX_LANGUAGE = [f"{a}{d}{x}" for a in ("ab", "cd") for d in "0123" for x in ("", "x")]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
    "required": ["name", "n", "ok", "color"],
    "additionalProperties": False,
}


def choice(options: list[str]) -> OutputConstraint:
    return OutputConstraint(ConstraintKind.CHOICE, json.dumps(options))


FINITE = [(choice(CHOICES), CHOICES), (OutputConstraint(ConstraintKind.REGEX, REGEX), REGEX_LANGUAGE)]


def brute_force_allowed(language: list[str], written: bytes, token_bytes: dict[int, bytes], eos: int) -> set[int]:
    """Brute force: the tokens after which the output is still the start of a word of `language`; EOS when it is one
    already."""
    words = [w.encode() for w in language]
    allowed = {t for t, b in token_bytes.items() if b and any(w.startswith(written + b) for w in words)}
    return allowed | ({eos} if written in words else set())


def mask_of(grammar: Grammar) -> set[int]:
    row = np.empty(grammar.vocab_words, dtype=np.int32)
    grammar.fill_mask(row)
    return {int(t) for t in np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0]}


@pytest.mark.parametrize("constraint, language", FINITE, ids=["choice", "regex"])
def test_greedy_draws_the_likeliest_token_the_constraint_allows(tiny_dir, constraint, language):
    """Replayed step by step beside a matcher of its own: each token is the likeliest of the model's logits among
    those the matcher allows, and every token the matcher allows keeps the output the start of a word of the
    language (a brute-force check; the matcher may allow fewer: llguidance keeps a literal's tokens canonical)."""
    engine, rows = make_recording_engine(tiny_dir, num_blocks=64, budget=256)
    vocabulary = grammar_vocabulary(engine.tokenizer, engine.model_config.vocab_size)
    eos = engine.tokenizer.eos_token_id
    token_bytes = {t: vocabulary.decode_bytes([t]) for t in range(engine.model_config.vocab_size)
                   if not vocabulary.is_special_token(t)}
    prompts = {f"g{i}": PROMPT[i:] for i in range(3)}
    for rid, ids in prompts.items():
        engine.add_request(greedy(rid, ids, max_tokens=20, ignore_eos=False, constraint=constraint))
    outputs = run(engine)
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size)
    for rid in prompts:
        ids = token_ids(outputs[rid])
        assert outputs[rid][-1].finish_reason is FinishReason.STOP and ids[-1] == eos
        steps = [step[rid] for step in rows if rid in step]
        assert len(steps) == len(ids)
        replay, written = compiler.start(constraint), b""
        for token, logits in zip(ids, steps):
            allowed = mask_of(replay)
            assert allowed and allowed <= brute_force_allowed(language, written, token_bytes, eos)
            assert token == max(allowed, key=lambda t: float(logits[t]))
            assert replay.accept(token)
            written += token_bytes.get(token, b"")
        assert written.decode() in language and text(outputs[rid]) == written.decode()
    assert all_free(engine)


@pytest.mark.parametrize("constraint, language", FINITE, ids=["choice", "regex"])
def test_sampled_outputs_are_words_of_the_language(tiny_dir, constraint, language):
    engine = make_engine(tiny_dir)
    for seed in range(12):
        engine.add_request(EngineRequest(request_id=f"s{seed}", prompt_token_ids=PROMPT, sampling=SamplingParams(
            max_tokens=20, temperature=1.5, seed=seed, constraint=constraint)))
    outputs = run(engine)
    for seed in range(12):
        assert outputs[f"s{seed}"][-1].finish_reason is FinishReason.STOP
        assert text(outputs[f"s{seed}"]) in language
    assert len({text(out) for out in outputs.values()}) > 1   # the draws differ: the mask is not a single path
    assert all_free(engine)


def follows_schema(value: object) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "n", "ok", "color"}
            and isinstance(value["name"], str) and len(value["name"]) <= 5
            and type(value["n"]) is int and 0 <= value["n"] <= 99
            and isinstance(value["ok"], bool) and value["color"] in ("red", "green"))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_json_schema_gives_json_that_follows_it(tiny_dir, temperature):
    constraint = OutputConstraint(ConstraintKind.JSON, json.dumps(SCHEMA), disable_any_whitespace=True)
    engine = make_engine(tiny_dir)
    for seed in range(6):
        engine.add_request(EngineRequest(request_id=f"j{seed}", prompt_token_ids=PROMPT[seed:], sampling=SamplingParams(
            max_tokens=120, temperature=temperature, seed=seed, constraint=constraint)))
    outputs = run(engine)
    for rid, out in outputs.items():
        assert out[-1].finish_reason is FinishReason.STOP, text(out)
        assert follows_schema(json.loads(text(out)))
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', '""', text(out)))   # none outside the strings
    assert all_free(engine)


def test_a_json_object_is_any_object(tiny_dir):
    engine = make_engine(tiny_dir)
    constraint = OutputConstraint(ConstraintKind.JSON_OBJECT, "", disable_any_whitespace=True)
    engine.add_request(greedy("o", PROMPT, max_tokens=200, ignore_eos=False, constraint=constraint))
    out = run(engine)["o"]
    if out[-1].finish_reason is FinishReason.STOP:
        assert isinstance(json.loads(text(out)), dict)
    else:   # a random model may write a long object: what it wrote is the start of one
        assert text(out).startswith("{")
    assert all_free(engine)


def test_a_prefill_node_draws_its_first_token_under_the_constraint(tiny_dir):
    engine = make_engine(tiny_dir)
    engine.set_remote(FakeLoader(), hold_handler=lambda seq, logprob: {"held": True}, decode_skip_mamba_align=True)
    engine.add_request(EngineRequest(request_id="p", prompt_token_ids=PROMPT, kv_transfer=RemoteDecodeParams(),
                                     sampling=SamplingParams(max_tokens=1, temperature=0.0,
                                                             constraint=choice(["zebra"]))))
    out, = run(engine)["p"]
    assert engine.tokenizer.decode(list(out.new_token_ids)) in ("z", "ze", "zeb", "zebr", "zebra")
    engine.kv.free("p")
    assert all_free(engine)


def _after_first(engine, first_text: str, max_tokens: int) -> EngineRequest:
    """A decode node's request of the choices whose prefill node drew `first_text`'s token first."""
    first = engine.tokenizer.encode(first_text, add_special_tokens=False)[0]
    return EngineRequest(request_id="d", prompt_token_ids=PROMPT[:20],
                         sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, constraint=choice(CHOICES)),
                         kv_transfer=remote_params_for(engine, 20, first_token_id=first))


def test_a_decode_node_follows_on_from_the_first_token(tiny_dir):
    """The prefill node drew 'c' of the choices: this node's outputs go on within 'cherry tart'."""
    engine, loader = decode_node(tiny_dir)
    outputs = decode_remotely(engine, loader, _after_first(engine, "c", max_tokens=20))
    assert text(outputs) == "cherry tart" and outputs[-1].finish_reason is FinishReason.STOP
    assert all_free(engine)


def test_a_first_token_the_constraint_does_not_allow_is_refused(tiny_dir):
    engine, _ = decode_node(tiny_dir)
    with pytest.raises(InvalidRequestError) as caught:
        engine.add_request(_after_first(engine, "z", max_tokens=4))
    assert caught.value.param == "kv_transfer_params"
    assert engine.request_ids() == [] and all_free(engine)
