"""The logits processors against vLLM's definitions written out token by token (a brute-force reference), table
cases on a tiny vocabulary, min_p, and how sampling takes them (logprobs of the logits as they came, seeds)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpd.engine.logits_processors import TokenHistory, min_p_filter, process_logits, process_rows
from hybridpd.engine.sampling import sample, sample_one
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.errors import InvalidRequestError

torch.set_num_threads(1)

VOCAB = 12
EOS = frozenset({11})
INF = float("inf")


def reference(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int],
              eos: frozenset[int]) -> list[float]:
    """vLLM's sampler, one token at a time: allowed_token_ids, min_tokens, logit_bias, repetition, frequency,
    presence."""
    out = list(logits)
    for token in range(len(out)):
        if params.allowed_token_ids is not None and token not in params.allowed_token_ids:
            out[token] = -INF
        for word in params.bad_words_token_ids:   # the output followed by this token would end with the word
            if word[-1] == token and (output + [token])[-len(word):] == list(word):
                out[token] = -INF
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
        if len(output) < params.min_tokens and token in stops:
            out[token] = -INF
        out[token] += dict(params.logit_bias).get(token, 0.0)
        if token in prompt or token in output:
            r = params.repetition_penalty
            out[token] = out[token] / r if out[token] > 0 else out[token] * r
        count = output.count(token)
        out[token] -= params.frequency_penalty * count
        out[token] -= params.presence_penalty * (count > 0)
    return out


def check(logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]) -> None:
    got = process_logits(torch.tensor(logits), params, TokenHistory(prompt, output), EOS).tolist()
    want = reference(logits, params, prompt, output, EOS)
    for g, w in zip(got, want):
        assert (g == w == -INF) or math.isclose(g, w, rel_tol=1e-5, abs_tol=1e-5), (got, want)


BASE = [2.0, -1.0, 0.5, 0.0, 3.0, -2.5, 1.0, 0.25, -0.5, 4.0, 1.5, 2.5]


@pytest.mark.parametrize("params, prompt, output, expected", [
    # repetition 2: token 0 (prompt, +2.0) halves, token 1 (output, -1.0) doubles, the others stay
    (SamplingParams(repetition_penalty=2.0), [0], [1], {0: 1.0, 1: -2.0, 2: 0.5}),
    # frequency 0.5: token 4 twice in the output -> 3.0 - 1.0; the prompt does not count
    (SamplingParams(frequency_penalty=0.5), [2], [4, 4], {4: 2.0, 2: 0.5}),
    # presence 1.5: once is enough, the count does not matter
    (SamplingParams(presence_penalty=1.5), [], [4, 4, 6], {4: 1.5, 6: -0.5, 0: 2.0}),
    # a negative penalty encourages
    (SamplingParams(presence_penalty=-1.0), [], [3], {3: 1.0}),
    # logit_bias adds
    (SamplingParams(logit_bias=((5, 100.0), (9, -100.0))), [], [], {5: 97.5, 9: -96.0}),
    # min_tokens masks EOS (11) and stop_token_ids until the output holds that many
    (SamplingParams(min_tokens=2, stop_token_ids=(3,)), [], [7], {11: -INF, 3: -INF, 4: 3.0}),
    (SamplingParams(min_tokens=2, stop_token_ids=(3,)), [], [7, 7], {11: 2.5, 3: 0.0}),
    # ... and with ignore_eos only the stop token ids
    (SamplingParams(min_tokens=2, stop_token_ids=(3,), ignore_eos=True), [], [], {11: 2.5, 3: -INF}),
    # allowed_token_ids masks the rest
    (SamplingParams(allowed_token_ids=(1, 4)), [], [], {1: -1.0, 4: 3.0, 0: -INF, 9: -INF}),
    # bad words: one token always; more only after the others, in the output (the prompt does not count)
    (SamplingParams(bad_words_token_ids=((9,), (1, 2, 4))), [1, 2], [], {9: -INF, 4: 3.0}),
    (SamplingParams(bad_words_token_ids=((9,), (1, 2, 4))), [], [7, 1, 2], {9: -INF, 4: -INF, 2: 0.5}),
    (SamplingParams(bad_words_token_ids=((1, 2, 4),)), [], [2, 1], {4: 3.0}),
])
def test_each_processor_on_a_tiny_vocabulary(params, prompt, output, expected):
    got = process_logits(torch.tensor(BASE), params, TokenHistory(prompt, output), EOS)
    for token, value in expected.items():
        assert got[token].item() == pytest.approx(value), token
    check(BASE, params, prompt, output)


def test_the_input_row_is_not_changed():
    logits = torch.tensor(BASE)
    process_logits(logits, SamplingParams(repetition_penalty=3.0, logit_bias=((0, 5.0),)),
                   TokenHistory([0, 1], [2]), EOS)
    assert logits.tolist() == BASE


@settings(max_examples=150, deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20, allow_nan=False), min_size=VOCAB, max_size=VOCAB),
    prompt=st.lists(st.integers(0, VOCAB - 1), max_size=8),
    output=st.lists(st.integers(0, VOCAB - 1), max_size=8),
    repetition=st.floats(0.1, 3.0),
    frequency=st.floats(-2, 2),
    presence=st.floats(-2, 2),
    min_tokens=st.integers(0, 10),
    stops=st.lists(st.integers(0, VOCAB - 1), max_size=3),
    bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=4),
    allowed=st.none() | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
    ignore_eos=st.booleans(),
)
def test_all_processors_together_match_the_reference(logits, prompt, output, repetition, frequency, presence,
                                                     min_tokens, stops, bias, allowed, ignore_eos):
    params = SamplingParams(max_tokens=16, repetition_penalty=repetition, frequency_penalty=frequency,
                            presence_penalty=presence, min_tokens=min_tokens, stop_token_ids=tuple(stops),
                            logit_bias=tuple(sorted(bias.items())), ignore_eos=ignore_eos,
                            allowed_token_ids=None if allowed is None else tuple(dict.fromkeys(allowed)))
    check(logits, params, prompt, output)


@pytest.mark.parametrize("min_p, kept", [
    (0.0, {0, 1, 2, 3}),
    (0.5, {0, 1}),      # 0.3 >= 0.5 x 0.5; 0.15 is not
    (0.3, {0, 1, 2}),   # 0.15 >= 0.15
    (1.0, {0}),
])
def test_min_p_keeps_tokens_at_least_that_fraction_of_the_likeliest(min_p, kept):
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    out = min_p_filter(logits, min_p)
    assert {i for i, v in enumerate(out.tolist()) if v != -INF} == kept


def test_min_p_draws_only_what_it_keeps():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    g = torch.Generator().manual_seed(0)
    drawn = {sample_one(logits, SamplingParams(temperature=1.0, min_p=0.5), g).token_id for _ in range(300)}
    assert drawn == {0, 1}


def test_a_penalty_changes_the_greedy_choice_and_logprobs_stay_those_of_the_model():
    logits = torch.tensor(BASE)
    params = SamplingParams(temperature=0.0, repetition_penalty=4.0, logprobs=1)
    picked = sample_one(logits, params, None, TokenHistory([9], []), EOS)
    assert picked.token_id == 4          # 9 (4.0) is in the prompt: 1.0 after the penalty, below 4's 3.0
    assert picked.logprob.top[0][0] == 9  # the top logprob is the model's own choice (vLLM's raw logprobs)
    assert picked.logprob.logprob == pytest.approx(torch.log_softmax(logits, -1)[4].item())


def test_batched_sample_routes_processed_rows_apart_and_keeps_order():
    logits = torch.stack([torch.tensor(BASE)] * 3)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logit_bias=((5, 100.0),)),
              SamplingParams(temperature=0.0)]
    out = sample(logits, params, [None] * 3, [None, TokenHistory([], []), None], EOS)
    assert [o.token_id for o in out] == [9, 5, 9]


def test_a_row_that_needs_its_history_without_one_is_an_error():
    with pytest.raises(ValueError, match="history"):
        sample_one(torch.tensor(BASE), SamplingParams(presence_penalty=1.0), None)


def test_seeded_draws_with_processors_repeat():
    logits = torch.tensor(BASE)
    params = SamplingParams(temperature=1.0, seed=5, frequency_penalty=1.0, min_p=0.05)
    history = TokenHistory([1, 2], [4, 9])

    def run() -> list[int]:
        g = torch.Generator().manual_seed(5)
        return [sample_one(logits, params, g, history, EOS).token_id for _ in range(20)]
    assert run() == run()


@pytest.mark.parametrize("fields, param", [
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"min_tokens": 17}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
    ({"allowed_token_ids": ()}, "allowed_token_ids"),
])
def test_out_of_range_parameters_are_refused_by_name(fields, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(max_tokens=16, **fields)
    assert info.value.param == param


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),    # prompt
    st.lists(st.integers(0, VOCAB - 1), max_size=6),                # output
    st.sampled_from([1.0, 0.5, 1.7]), st.sampled_from([0.0, 0.8]), st.sampled_from([0.0, -1.2]),
    st.integers(0, 4), st.booleans()), min_size=1, max_size=5), seed=st.integers(0, 1000))
def test_rows_processed_together_equal_each_alone(rows, seed):
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    params, histories = [], []
    for prompt, output, repetition, frequency, presence, min_tokens, biased in rows:
        params.append(SamplingParams(max_tokens=8, repetition_penalty=repetition, frequency_penalty=frequency,
                                     presence_penalty=presence, min_tokens=min_tokens,
                                     logit_bias=((3, 2.5),) if biased else ()))
        histories.append(TokenHistory(torch.tensor(prompt), output))
    together = process_rows(logits, params, histories, EOS)
    for r in range(len(rows)):
        assert torch.equal(together[r], process_logits(logits[r], params[r], histories[r], EOS))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3), min_size=1, max_size=3),
       st.lists(st.lists(st.floats(-5, 5), min_size=VOCAB, max_size=VOCAB), min_size=12, max_size=12))
def test_greedy_output_never_holds_a_bad_word(words, steps):
    """Whatever the logits, a greedy output never holds a bad word's tokens, checked against the output itself (a
    word whose every ending is masked leaves the other tokens)."""
    params = SamplingParams(bad_words_token_ids=tuple(tuple(w) for w in words))
    output: list[int] = []
    for logits in steps:
        row = process_logits(torch.tensor(logits), params, TokenHistory([], output), EOS)
        check(logits, params, [], output)
        output.append(int(row.argmax()))
    for word in params.bad_words_token_ids:
        assert all(output[i:i + len(word)] != list(word) for i in range(len(output))), (word, output)
