"""Benchmark prompts: random token ids, shared prefixes with random suffixes, a JSONL file, or a Mooncake trace.

Every generator takes its own `numpy.random.Generator` seeded from `--seed`, so a seed fixes the
prompts (and nothing else in the process is touched). Token ids are always in `[0, vocab_size)`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridpd.bench import mooncake
from hybridpd.bench.arrivals import arrival_offsets
from hybridpd.bench.config import (
    BenchConfig,
    CustomDatasetConfig,
    DatasetName,
    PrefixRepetitionConfig,
    RandomDatasetConfig,
)


@dataclass(frozen=True, kw_only=True)
class SampleRequest:
    prompt: str | tuple[int, ...]
    prompt_len: int            # tokens for a token-id prompt; 0 for text (the answer's usage tells)
    expected_output_len: int

    def prompt_for_wire(self) -> str | list[int]:
        return self.prompt if isinstance(self.prompt, str) else list(self.prompt)


def _length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's inclusive range: [floor(L(1-r)), ceil(L(1+r))], at least 1 token."""
    low = max(1, math.floor(length * (1.0 - range_ratio)))
    high = max(low, math.ceil(length * (1.0 + range_ratio)))
    return low, high


def sample_random(
    config: RandomDatasetConfig, *, num_prompts: int, vocab_size: int, rng: np.random.Generator
) -> list[SampleRequest]:
    """`num_prompts` prompts of `prefix_len` shared random ids + an own run of consecutive ids.

    Like vLLM's random dataset: prompt i's own part is `(offset_i + i + arange(len_i)) % vocab_size`
    with a random offset, so no two prompts share more than the common prefix by accident.
    """
    in_low, in_high = _length_range(config.input_len, config.range_ratio)
    out_low, out_high = _length_range(config.output_len, config.range_ratio)
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    offsets = rng.integers(0, vocab_size, size=num_prompts)
    prefix = tuple(int(t) for t in rng.integers(0, vocab_size, size=config.prefix_len))
    requests = []
    for i in range(num_prompts):
        own = (offsets[i] + i + np.arange(input_lens[i])) % vocab_size
        tokens = prefix + tuple(int(t) for t in own)
        requests.append(
            SampleRequest(prompt=tokens, prompt_len=len(tokens), expected_output_len=int(output_lens[i]))
        )
    return requests


def sample_prefix_repetition(
    config: PrefixRepetitionConfig, *, num_prompts: int, vocab_size: int, rng: np.random.Generator
) -> list[SampleRequest]:
    """`num_prefixes` random prefixes; prompt i = prefix (i mod num_prefixes) + its own random suffix.

    The order is shuffled afterwards, so requests sharing a prefix do not arrive back to back.
    """
    prefixes = [
        tuple(int(t) for t in rng.integers(0, vocab_size, size=config.prefix_len))
        for _ in range(config.num_prefixes)
    ]
    requests = []
    for i in range(num_prompts):
        suffix = tuple(int(t) for t in rng.integers(0, vocab_size, size=config.suffix_len))
        tokens = prefixes[i % config.num_prefixes] + suffix
        requests.append(SampleRequest(prompt=tokens, prompt_len=len(tokens), expected_output_len=config.output_len))
    return [requests[int(j)] for j in rng.permutation(num_prompts)]


def _parse_custom_line(line: str, *, where: str, default_output_len: int) -> SampleRequest:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict) or "prompt" not in record:
        raise ValueError(f'{where}: each line must be an object with a "prompt"')
    prompt = record["prompt"]
    output_len = record.get("output_tokens", default_output_len)
    if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
        raise ValueError(f'{where}: "output_tokens" must be a positive integer, got {output_len!r}')
    if isinstance(prompt, str) and prompt:
        return SampleRequest(prompt=prompt, prompt_len=0, expected_output_len=output_len)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
        return SampleRequest(prompt=tuple(prompt), prompt_len=len(prompt), expected_output_len=output_len)
    raise ValueError(f'{where}: "prompt" must be a non-empty string or list of token ids')


def load_custom(config: CustomDatasetConfig, *, num_prompts: int, rng: np.random.Generator) -> list[SampleRequest]:
    """Lines of `{"prompt": str | [ids], "output_tokens"?: n}`: shuffled, the first `num_prompts` taken;
    a file with fewer lines is oversampled (random repeats), as vLLM does."""
    if config.path is None:
        raise ValueError("--dataset-name custom needs --dataset-path FILE.jsonl")
    path = Path(config.path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read --dataset-path {path}: {exc.strerror}") from None
    samples = [
        _parse_custom_line(line, where=f"{path}:{number}", default_output_len=config.output_len)
        for number, line in enumerate(lines, start=1)
        if line.strip()
    ]
    if not samples:
        raise ValueError(f"{path}: no prompts")
    shuffled = [samples[int(j)] for j in rng.permutation(len(samples))]
    extra = [shuffled[int(j)] for j in rng.integers(0, len(shuffled), size=max(0, num_prompts - len(shuffled)))]
    return (shuffled + extra)[:num_prompts]


@dataclass(frozen=True, kw_only=True)
class Workload:
    samples: tuple[SampleRequest, ...]
    offsets_s: tuple[float, ...]               # when each is sent, seconds after the start
    ideal_hit_rate: float | None = None        # a trace slice's, with an unbounded cache (bench/mooncake.py)


def load_trace(config: BenchConfig, *, vocab_size: int, rng: np.random.Generator) -> Workload:
    assert config.dataset_path is not None
    trace = config.trace
    records = mooncake.select(mooncake.read_trace(config.dataset_path), trace)
    if not records:
        raise ValueError(f"{config.dataset_path}: no request in the slice (--trace-start {trace.start_s}, "
                         f"--trace-duration {trace.duration_s})")
    cap = trace.max_output_len
    samples = []
    for record in records:
        tokens = mooncake.prompt_tokens(record, trace.tokens_per_hash, vocab_size, rng)
        output = min(record.output_length, cap) if cap is not None else record.output_length
        samples.append(SampleRequest(prompt=tokens, prompt_len=len(tokens), expected_output_len=output))
    hits, total = mooncake.ideal_hit_tokens(records, trace.tokens_per_hash)
    return Workload(samples=tuple(samples), offsets_s=tuple(mooncake.arrival_offsets(records, trace)),
                    ideal_hit_rate=hits / total)


def build_workload(config: BenchConfig, *, vocab_size: int) -> Workload:
    """The run's prompts and their send times: a trace's own, or `--request-rate` with `--burstiness`."""
    if config.dataset is DatasetName.MOONCAKE_TRACE:
        return load_trace(config, vocab_size=vocab_size, rng=np.random.default_rng(config.seed))
    samples = build_samples(config, vocab_size=vocab_size)
    offsets = arrival_offsets(len(samples), request_rate=config.request_rate, burstiness=config.burstiness,
                              rng=np.random.default_rng([config.seed, 1]))
    return Workload(samples=tuple(samples), offsets_s=tuple(offsets))


def build_samples(config: BenchConfig, *, vocab_size: int) -> list[SampleRequest]:
    """The run's prompts, from one generator seeded with `--seed`."""
    rng = np.random.default_rng(config.seed)
    match config.dataset:
        case DatasetName.RANDOM:
            return sample_random(config.random, num_prompts=config.num_prompts, vocab_size=vocab_size, rng=rng)
        case DatasetName.PREFIX_REPETITION:
            return sample_prefix_repetition(
                config.prefix_repetition, num_prompts=config.num_prompts, vocab_size=vocab_size, rng=rng
            )
        case DatasetName.CUSTOM:
            return load_custom(config.custom, num_prompts=config.num_prompts, rng=rng)
        case DatasetName.MOONCAKE_TRACE:
            return list(build_workload(config, vocab_size=vocab_size).samples)
