"""Mooncake traces (`--dataset-name mooncake_trace`): production arrival times and prefix sharing, replayed with
synthetic token ids.

A trace line is `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`, one hash id per
`TRACE_BLOCK` (512) prompt tokens: equal ids mean an equal prefix block (the same format AIPerf and SGLang's bench
read). To fit a small machine the replay scales it: `tokens_per_hash` tokens stand for each id (lengths scale with
them), `time_scale` multiplies the times, a slice of the trace (`start_s`, `duration_s`, `max_requests`) is taken and
outputs are capped (`max_output_len`).

Token synthesis: the prompt's full blocks are `block_tokens(id)`, a deterministic function of the id alone (the same
in every process and run), so equal ids give equal blocks and the trace's sharing is reproduced exactly; the rest of
a request's last block is drawn from the run's generator and is the request's own.

The slice's ideal hit rate: with an unbounded cache, a request hits every leading full block whose id an earlier
request of the slice had as a full block (ids are prefix-chained, so an id seen means its whole prefix was seen); the
rate is those tokens over all prompt tokens. It bounds what any cluster can reach on the slice.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TRACE_BLOCK = 512          # prompt tokens per hash id in the published traces
_BLOCK_STREAM = 0x6D6F6F6E  # seeds every block's generator beside its id ("moon"), apart from the run's --seed


@dataclass(frozen=True, kw_only=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class TraceSlice:
    tokens_per_hash: int = TRACE_BLOCK
    time_scale: float = 1.0
    start_s: float = 0.0
    duration_s: float | None = None
    max_requests: int | None = None
    max_output_len: int | None = None

    def __post_init__(self) -> None:
        if self.tokens_per_hash < 1:
            raise ValueError(f"--trace-tokens-per-hash must be >= 1, got {self.tokens_per_hash}")
        if not self.time_scale > 0:
            raise ValueError(f"--trace-time-scale must be positive, got {self.time_scale}")
        if self.start_s < 0 or (self.duration_s is not None and not self.duration_s > 0):
            raise ValueError("--trace-start must be >= 0 and --trace-duration positive")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"--trace-max-requests must be >= 1, got {self.max_requests}")
        if self.max_output_len is not None and self.max_output_len < 1:
            raise ValueError(f"--trace-max-output-len must be >= 1, got {self.max_output_len}")


def _int_field(record: dict, name: str, where: str, minimum: int) -> int:
    value = record.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{where}: {name!r} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_record(line: str, where: str) -> TraceRecord:
    """One trace line; raises ValueError naming `where` (file:line) and what is wrong."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a trace line is a JSON object")
    timestamp = record.get("timestamp")
    if not isinstance(timestamp, (int, float)) or isinstance(timestamp, bool) or not 0 <= timestamp < math.inf:
        raise ValueError(f"{where}: 'timestamp' must be a non-negative number of milliseconds, got {timestamp!r}")
    input_length = _int_field(record, "input_length", where, 1)
    output_length = _int_field(record, "output_length", where, 1)
    hash_ids = record.get("hash_ids")
    if not isinstance(hash_ids, list) or not hash_ids or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids):
        raise ValueError(f"{where}: 'hash_ids' must be a non-empty list of non-negative integers")
    blocks = -(-input_length // TRACE_BLOCK)
    if blocks != len(hash_ids):
        raise ValueError(f"{where}: input_length {input_length} spans {blocks} blocks of {TRACE_BLOCK} tokens, but "
                         f"it has {len(hash_ids)} hash ids")
    return TraceRecord(timestamp_ms=float(timestamp), input_length=input_length, output_length=output_length,
                       hash_ids=tuple(hash_ids))


def read_trace(path: Path) -> list[TraceRecord]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read --dataset-path {path}: {exc.strerror}") from None
    records = [parse_record(line, f"{path}:{number}") for number, line in enumerate(lines, start=1) if line.strip()]
    if not records:
        raise ValueError(f"{path}: no trace lines")
    return records


def select(records: Sequence[TraceRecord], trace: TraceSlice) -> list[TraceRecord]:
    """The slice [start, start + duration) of trace time, in time order, at most `max_requests` of it."""
    start_ms = trace.start_s * 1000
    end_ms = math.inf if trace.duration_s is None else start_ms + trace.duration_s * 1000
    chosen = sorted((r for r in records if start_ms <= r.timestamp_ms < end_ms), key=lambda r: r.timestamp_ms)
    return chosen[:trace.max_requests] if trace.max_requests is not None else chosen


def history(records: Sequence[TraceRecord], trace: TraceSlice, seconds: float) -> list[TraceRecord]:
    """The `seconds` of trace before the slice, in time order: what a cluster served before the slice begins (the
    trace's prefixes come back minutes later, so a slice replayed on empty caches sees little of its reuse)."""
    if seconds < 0:
        raise ValueError(f"the history must be >= 0 s, got {seconds}")
    end_ms = trace.start_s * 1000
    return sorted((r for r in records if end_ms - seconds * 1000 <= r.timestamp_ms < end_ms),
                  key=lambda r: r.timestamp_ms)


def scaled_length(record: TraceRecord, tokens_per_hash: int) -> int:
    return max(1, round(record.input_length * tokens_per_hash / TRACE_BLOCK))


def block_tokens(hash_id: int, tokens_per_hash: int, vocab_size: int) -> tuple[int, ...]:
    """The tokens standing for `hash_id`: a function of the id alone, the same in every process."""
    rng = np.random.Generator(np.random.PCG64([_BLOCK_STREAM, hash_id]))
    return tuple(int(t) for t in rng.integers(0, vocab_size, size=tokens_per_hash))


def prompt_tokens(record: TraceRecord, tokens_per_hash: int, vocab_size: int,
                  rng: np.random.Generator) -> tuple[int, ...]:
    """The full blocks from the record's ids, then the rest of its last block, its own."""
    length = scaled_length(record, tokens_per_hash)
    full = min(length // tokens_per_hash, len(record.hash_ids))
    tokens: list[int] = []
    for hash_id in record.hash_ids[:full]:
        tokens.extend(block_tokens(hash_id, tokens_per_hash, vocab_size))
    tokens.extend(int(t) for t in rng.integers(0, vocab_size, size=length - len(tokens)))
    return tuple(tokens)


def ideal_hit_tokens(records: Iterable[TraceRecord], tokens_per_hash: int,
                     history: Iterable[TraceRecord] = ()) -> tuple[int, int]:
    """(hit tokens, prompt tokens) of the slice with an unbounded cache: each request hits its leading full blocks
    whose ids an earlier request had, in the slice or its `history` (requests served before it, not counted)."""
    seen = {h for r in history for h in _full_block_ids(r, tokens_per_hash)}
    hits = total = 0
    for record in records:
        full = _full_block_ids(record, tokens_per_hash)
        leading = 0
        while leading < len(full) and full[leading] in seen:
            leading += 1
        hits += leading * tokens_per_hash
        total += scaled_length(record, tokens_per_hash)
        seen.update(full)
    return hits, total


def _full_block_ids(record: TraceRecord, tokens_per_hash: int) -> tuple[int, ...]:
    """The ids of the record's full blocks (a partial last block is the request's own)."""
    return record.hash_ids[:min(scaled_length(record, tokens_per_hash) // tokens_per_hash, len(record.hash_ids))]


def arrival_offsets(records: Sequence[TraceRecord], trace: TraceSlice) -> list[float]:
    """Seconds after the replay's start at which each request is sent: its trace time from the slice's start,
    times `time_scale`."""
    start_ms = trace.start_s * 1000
    return [(r.timestamp_ms - start_ms) / 1000 * trace.time_scale for r in records]
