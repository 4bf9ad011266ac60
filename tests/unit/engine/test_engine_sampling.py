"""Sampling: greedy paths agree with argmax, seeds reproduce, filters cut what they should, logprobs are sane.

Every random draw uses a generator with a fixed seed, so no assertion here depends on luck.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from hybridpd.engine.sampling import sample, sample_one, skip_draw
from hybridpd.engine.sampling_params import SamplingParams

torch.set_num_threads(1)

VOCAB = 258


def random_logits(seed: int, n: int = VOCAB) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    g = gen(seed)
    return [sample_one(logits, params, g).token_id for _ in range(n)]


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=1),
    SamplingParams(temperature=1.0, top_p=1e-6),
    SamplingParams(temperature=2.0, top_p=1e-6, top_k=50),
    SamplingParams(temperature=0.0, logprobs=3),
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_like_settings_pick_the_argmax(params, seed):
    logits = random_logits(seed)
    picked = {sample_one(logits, params, gen(s)).token_id for s in range(5)}
    assert picked == {int(torch.argmax(logits))}


def test_batched_sample_keeps_row_order_and_mixes_kinds():
    logits = torch.stack([random_logits(s) for s in range(4)])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.0, logprobs=2), SamplingParams(top_k=1)]
    gens = [None, gen(3), None, None]
    out = sample(logits, params, gens)
    argmax = logits.argmax(-1).tolist()
    assert [out[i].token_id for i in (0, 2, 3)] == [argmax[0], argmax[2], argmax[3]]
    assert out[1].token_id == sample_one(logits[1], params[1], gen(3)).token_id
    assert out[0].logprob is None and out[2].logprob is not None


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=20),
    SamplingParams(temperature=1.3, top_p=0.9),
])
def test_same_seed_same_tokens_other_seed_other_tokens(params):
    logits = random_logits(7) / 3   # flatter: many tokens are likely
    first = draws(logits, params, 24, seed=11)
    again = draws(logits, params, 24, seed=11)
    other = draws(logits, params, 24, seed=12)
    assert first == again
    assert first != other


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(temperature=1.0, top_k=2), {0, 1}),
    (SamplingParams(temperature=1.0, top_k=3), {0, 1, 2}),
    (SamplingParams(temperature=1.0, top_p=0.6), {0, 1}),      # 0.5 < 0.6: the second token is still needed
    (SamplingParams(temperature=1.0, top_p=0.5), {0}),         # the first token reaches 0.5 on its own
    (SamplingParams(temperature=1.0, top_p=0.81), {0, 1, 2}),
    (SamplingParams(temperature=1.0, top_k=3, top_p=0.6), {0, 1}),
    (SamplingParams(temperature=1.0), {0, 1, 2, 3}),
    (SamplingParams(temperature=1.0, top_k=-1), {0, 1, 2, 3}),
    (SamplingParams(temperature=1.0, top_k=100), {0, 1, 2, 3}),
])
def test_filters_keep_exactly_the_allowed_tokens(params, allowed):
    seen = set(draws(LOGITS, params, 400))
    assert seen == allowed


@pytest.mark.parametrize("temperature, expected", [
    (1.0, PROBS),
    (0.5, PROBS**2 / (PROBS**2).sum()),
    (2.0, PROBS**0.5 / (PROBS**0.5).sum()),
])
def test_temperature_scales_the_distribution(temperature, expected):
    n = 4000
    counts = Counter(draws(LOGITS, SamplingParams(temperature=temperature), n, seed=5))
    freq = torch.tensor([counts[i] / n for i in range(4)])
    # A fixed generator makes this deterministic; 0.03 is > 4 standard errors for every entry at n=4000.
    assert torch.allclose(freq, expected.float(), atol=0.03), (freq, expected)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprobs_of_the_chosen_token_and_sorted_top(temperature, k):
    logits = random_logits(3)
    reference = torch.log_softmax(logits, -1)
    out = sample_one(logits, SamplingParams(temperature=temperature, logprobs=k), gen(0))
    assert out.logprob is not None and out.logprob.token_id == out.token_id
    assert out.logprob.logprob == pytest.approx(float(reference[out.token_id]), abs=1e-5)
    assert len(out.logprob.top) == k
    values = [v for _, v in out.logprob.top]
    assert values == sorted(values, reverse=True)
    assert [i for i, _ in out.logprob.top] == reference.topk(k).indices.tolist()
    assert all(v <= 0 and math.isfinite(v) for v in values)


def test_no_logprobs_unless_asked():
    assert sample_one(random_logits(0), SamplingParams(temperature=1.0), gen(0)).logprob is None


@pytest.mark.parametrize("temperature", [1e-40])
def test_a_tiny_temperature_behaves_like_greedy(temperature):
    logits = random_logits(1)
    assert sample_one(logits, SamplingParams(temperature=temperature), gen(0)).token_id == int(logits.argmax())


def test_batched_random_rows_draw_what_each_row_draws_alone():
    """The shared softmax and race of `sample` give every seeded row the token `sample_one` gives it alone, with
    filtered, greedy and logprob rows in between (each row's noise comes from its own generator)."""
    logits = torch.stack([random_logits(s) / 3 for s in range(6)])
    params = [SamplingParams(temperature=0.5, seed=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, seed=2), SamplingParams(temperature=1.3, top_p=0.9, seed=3),
              SamplingParams(temperature=2.0, seed=4), SamplingParams(temperature=0.9, logprobs=1, seed=5)]
    for round_ in range(5):
        out = sample(logits, params, [gen(p.seed + round_) if p.seed else None for p in params])
        alone = [sample_one(logits[i], p, gen(p.seed + round_) if p.seed else None) for i, p in enumerate(params)]
        assert [o.token_id for o in out] == [a.token_id for a in alone]


def test_skip_draw_advances_a_generator_as_a_draw_does():
    """The P/D contract: the decode node skips the prefill node's first draw, then draws what a colocated node
    draws next."""
    logits = random_logits(3) / 3
    params = SamplingParams(temperature=1.0, seed=9)
    drawn, skipped = gen(9), gen(9)
    sample_one(logits, params, drawn)
    skip_draw(skipped, VOCAB)
    assert [sample_one(logits, params, drawn).token_id for _ in range(16)] == \
           [sample_one(logits, params, skipped).token_id for _ in range(16)]


def test_batched_rows_follow_their_temperatures():
    temperatures = (1.0, 0.5, 2.0)
    expected = [PROBS**(1 / t) / (PROBS**(1 / t)).sum() for t in temperatures]
    n = 4000
    torch.manual_seed(0)   # the unseeded rows draw from the global generator
    logits = LOGITS.repeat(len(temperatures), 1)
    params = [SamplingParams(temperature=t) for t in temperatures]
    counts = [Counter() for _ in temperatures]
    for _ in range(n):
        for row, token in enumerate(sample(logits, params, [None] * len(params))):
            counts[row][token.token_id] += 1
    for row, want in enumerate(expected):
        freq = torch.tensor([counts[row][i] / n for i in range(4)])
        assert torch.allclose(freq, want.float(), atol=0.03), (temperatures[row], freq, want)


def test_unseeded_rows_of_a_batch_draw_apart():
    """Rows whose requests gave no seed take their noise in one call (from the default generator, or from the first
    row's own): each row still races on noise of its own (rows with the same distribution pick the same token at the
    rate independent draws do: sum p^2 = 0.365)."""
    torch.manual_seed(1)
    logits = LOGITS.repeat(2, 1)
    params = [SamplingParams(temperature=1.0)] * 2
    n = 2000
    same = sum(a.token_id == b.token_id for a, b in (sample(logits, params, [None, None]) for _ in range(n)))
    assert abs(same / n - float((PROBS ** 2).sum())) < 0.05, same / n
    own = [gen(7), gen(8)]   # unseeded requests' own generators: the batch's noise from the first
    same = sum(a.token_id == b.token_id for a, b in (sample(logits, params, own) for _ in range(n)))
    assert abs(same / n - float((PROBS ** 2).sum())) < 0.05, same / n


def test_a_seeded_row_among_unseeded_ones_draws_what_it_draws_alone():
    logits = torch.stack([random_logits(s) / 3 for s in range(4)])
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, seed=5),
              SamplingParams(temperature=1.2), SamplingParams(temperature=1.0)]
    for round_ in range(5):
        out = sample(logits, params, [gen(100 + round_), gen(5 + round_), gen(200 + round_), gen(300 + round_)])
        alone = sample_one(logits[1], params[1], gen(5 + round_))
        assert out[1].token_id == alone.token_id
