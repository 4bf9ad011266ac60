"""Sampling: greedy paths agree with argmax, seeds reproduce, filters cut what they should, logprobs are sane.

Every random draw uses a generator with a fixed seed, so no assertion here depends on luck.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from hybridpd.engine.sampling import sample, sample_one
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
