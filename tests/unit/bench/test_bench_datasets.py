"""Prompt generation: lengths, shared prefixes, seeds, token ids in range, JSONL parsing."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest

from hybridpd.bench.config import CustomDatasetConfig, PrefixRepetitionConfig, RandomDatasetConfig
from hybridpd.bench.datasets import load_custom, sample_prefix_repetition, sample_random


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.mark.parametrize(
    "input_len, output_len, ratio, prefix_len, vocab",
    [(32, 8, 0.0, 0, 250), (32, 8, 0.0, 16, 7), (100, 20, 0.5, 4, 100), (3, 1, 0.9, 0, 2)],
)
def test_random_lengths_prefix_and_ids(input_len, output_len, ratio, prefix_len, vocab):
    config = RandomDatasetConfig(input_len=input_len, output_len=output_len, range_ratio=ratio, prefix_len=prefix_len)
    samples = sample_random(config, num_prompts=50, vocab_size=vocab, rng=rng())
    assert len(samples) == 50
    in_low, in_high = max(1, math.floor(input_len * (1 - ratio))), math.ceil(input_len * (1 + ratio))
    out_low, out_high = max(1, math.floor(output_len * (1 - ratio))), math.ceil(output_len * (1 + ratio))
    for s in samples:
        assert isinstance(s.prompt, tuple) and s.prompt_len == len(s.prompt)
        assert in_low <= s.prompt_len - prefix_len <= in_high
        assert out_low <= s.expected_output_len <= out_high
        assert all(0 <= t < vocab for t in s.prompt)
        assert s.prompt[:prefix_len] == samples[0].prompt[:prefix_len]
    if ratio == 0.0:
        assert {s.prompt_len for s in samples} == {prefix_len + input_len}
        assert {s.expected_output_len for s in samples} == {output_len}
    else:
        assert len({s.prompt_len for s in samples}) > 1


@pytest.mark.parametrize("sampler, config", [
    (sample_random, RandomDatasetConfig(input_len=16, output_len=4, range_ratio=0.5)),
    (sample_prefix_repetition, PrefixRepetitionConfig(prefix_len=8, suffix_len=8, num_prefixes=2, output_len=4)),
])
def test_seed_fixes_the_prompts(sampler, config):
    def prompts(seed: int) -> list:
        return [s.prompt for s in sampler(config, num_prompts=10, vocab_size=250, rng=rng(seed))]

    assert prompts(3) == prompts(3)
    assert prompts(3) != prompts(4)


@pytest.mark.parametrize(
    "prefix_len, suffix_len, num_prefixes, num_prompts",
    [(16, 4, 3, 9), (16, 4, 3, 10), (8, 0, 1, 5), (0, 8, 2, 4)],
)
def test_prefix_repetition_shares_prefixes(prefix_len, suffix_len, num_prefixes, num_prompts):
    config = PrefixRepetitionConfig(
        prefix_len=prefix_len, suffix_len=suffix_len, num_prefixes=num_prefixes, output_len=7
    )
    samples = sample_prefix_repetition(config, num_prompts=num_prompts, vocab_size=50, rng=rng())
    assert len(samples) == num_prompts
    assert all(s.prompt_len == prefix_len + suffix_len == len(s.prompt) for s in samples)
    assert all(s.expected_output_len == 7 and all(0 <= t < 50 for t in s.prompt) for s in samples)
    uses = Counter(s.prompt[:prefix_len] for s in samples)
    if prefix_len:
        assert len(uses) == num_prefixes
        assert max(uses.values()) - min(uses.values()) <= 1     # round robin over the prefixes


def test_prefix_repetition_is_shuffled():
    config = PrefixRepetitionConfig(prefix_len=8, suffix_len=2, num_prefixes=4, output_len=2)
    samples = sample_prefix_repetition(config, num_prompts=40, vocab_size=250, rng=rng(0))
    first_prefixes = [s.prompt[:8] for s in samples]
    round_robin = [first_prefixes[i % 4] for i in range(40)]
    assert first_prefixes != round_robin


def test_custom_jsonl_lines_and_default_output_len(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "abc", "output_tokens": 5}, {"prompt": [1, 2, 3]}, {"prompt": "z"},
    ]) + "\n")
    samples = load_custom(CustomDatasetConfig(path=path, output_len=9), num_prompts=3, rng=rng())
    assert sorted((s.prompt, s.prompt_len, s.expected_output_len) for s in samples if isinstance(s.prompt, str)) == [
        ("abc", 0, 5), ("z", 0, 9)
    ]
    assert [(s.prompt, s.prompt_len) for s in samples if not isinstance(s.prompt, str)] == [((1, 2, 3), 3)]
    more = load_custom(CustomDatasetConfig(path=path), num_prompts=7, rng=rng())
    assert len(more) == 7 and {s.prompt for s in more} <= {"abc", (1, 2, 3), "z"}


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "not JSON"),
        ('{"text": "x"}', '"prompt"'),
        ('{"prompt": ""}', "non-empty"),
        ('{"prompt": [1, -2]}', "non-empty"),
        ('{"prompt": "x", "output_tokens": 0}', "output_tokens"),
    ],
)
def test_custom_rejects_bad_lines_with_their_line_number(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message) as error:
        load_custom(CustomDatasetConfig(path=path), num_prompts=2, rng=rng())
    assert "bad.jsonl:2" in str(error.value)
