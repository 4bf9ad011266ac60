"""The frozen configuration of one `hybridpd bench` run, built from argparse and validated once."""

from __future__ import annotations

import argparse
import enum
import math
from dataclasses import dataclass, field
from pathlib import Path

from hybridpd.bench.mooncake import TraceSlice

PERCENTILE_METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRIC_NAMES = ("ttft", "tpot", "e2el")
# Request fields `vllm bench serve`'s sampling flags set (--top-p for top_p, ...), sent only when given.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                   "repetition_penalty")
DEFAULT_RANDOM_VOCAB_SIZE = 250  # below 256 so every id is a byte of the byte tokenizer


class DatasetName(enum.Enum):
    RANDOM = "random"
    PREFIX_REPETITION = "prefix_repetition"
    CUSTOM = "custom"
    MOONCAKE_TRACE = "mooncake_trace"   # bench/mooncake.py

    @property
    def synthetic(self) -> bool:
        """Synthetic prompts ask for an exact output length, so `--ignore-eos` is on by default."""
        return self is not DatasetName.CUSTOM


class EndpointKind(enum.Enum):
    """The request/response shape, decided by the endpoint path."""

    COMPLETIONS = "openai"          # vLLM's backend name for /v1/completions
    CHAT = "openai-chat"            # and for /v1/chat/completions

    @classmethod
    def from_path(cls, path: str) -> EndpointKind:
        if path.rstrip("/").endswith("chat/completions"):
            return cls.CHAT
        if path.rstrip("/").endswith("completions"):
            return cls.COMPLETIONS
        raise ValueError(f"--endpoint must end with /completions or /chat/completions, got {path!r}")


@dataclass(frozen=True, kw_only=True)
class RandomDatasetConfig:
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0
    vocab_size: int | None = None  # None: the server's `vocab_size`, else DEFAULT_RANDOM_VOCAB_SIZE

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--random-input-len and --random-output-len must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.prefix_len < 0:
            raise ValueError(f"--random-prefix-len must be >= 0, got {self.prefix_len}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"--random-vocab-size must be >= 1, got {self.vocab_size}")


@dataclass(frozen=True, kw_only=True)
class PrefixRepetitionConfig:
    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    output_len: int = 128

    def __post_init__(self) -> None:
        if self.prefix_len < 0 or self.suffix_len < 0 or self.prefix_len + self.suffix_len < 1:
            raise ValueError("--prefix-repetition-prefix-len/--suffix-len must be >= 0 and not both 0")
        if self.num_prefixes < 1:
            raise ValueError(f"--prefix-repetition-num-prefixes must be >= 1, got {self.num_prefixes}")
        if self.output_len < 1:
            raise ValueError(f"--prefix-repetition-output-len must be >= 1, got {self.output_len}")


@dataclass(frozen=True, kw_only=True)
class CustomDatasetConfig:
    path: Path | None = None
    output_len: int = 256  # for lines without "output_tokens"

    def __post_init__(self) -> None:
        if self.output_len < 1:
            raise ValueError(f"--custom-output-len must be >= 1, got {self.output_len}")


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    base_url: str
    endpoint: str = "/v1/completions"
    backend: str | None = None               # None: the endpoint kind's name ("openai" / "openai-chat")
    model: str | None = None                 # None: the first model of GET /v1/models
    dataset: DatasetName = DatasetName.RANDOM
    num_prompts: int = 1000
    random: RandomDatasetConfig = field(default_factory=RandomDatasetConfig)
    prefix_repetition: PrefixRepetitionConfig = field(default_factory=PrefixRepetitionConfig)
    custom: CustomDatasetConfig = field(default_factory=CustomDatasetConfig)
    trace: TraceSlice = field(default_factory=TraceSlice)
    dataset_path: Path | None = None   # custom and mooncake_trace
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = True
    sampling: tuple[tuple[str, float | int], ...] = ()   # the SAMPLING_FIELDS given on the command line
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    metric_percentiles: tuple[float, ...] = (99.0,)
    goodput: tuple[tuple[str, float], ...] = ()           # (metric, SLO in ms)
    metrics_urls: tuple[str, ...] = ()
    disable_tqdm: bool = False
    save_result: bool = False
    result_dir: Path | None = None
    result_filename: str | None = None
    label: str | None = None

    def __post_init__(self) -> None:
        EndpointKind.from_path(self.endpoint)
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be positive (inf: all at once), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be positive, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        unknown = [m for m in self.percentile_metrics if m not in PERCENTILE_METRIC_NAMES]
        if unknown or not self.percentile_metrics:
            raise ValueError(f"--percentile-metrics takes names from {PERCENTILE_METRIC_NAMES}, got {unknown}")
        if not self.metric_percentiles or any(not 0 <= p <= 100 for p in self.metric_percentiles):
            raise ValueError(f"--metric-percentiles must be in [0, 100], got {self.metric_percentiles}")
        if self.dataset is DatasetName.CUSTOM and self.custom.path is None:
            raise ValueError("--dataset-name custom needs --dataset-path FILE.jsonl")
        if self.dataset is DatasetName.MOONCAKE_TRACE and self.dataset_path is None:
            raise ValueError("--dataset-name mooncake_trace needs --dataset-path TRACE.jsonl")
        if self.dataset is DatasetName.PREFIX_REPETITION and self.num_prompts < self.prefix_repetition.num_prefixes:
            raise ValueError(
                f"--num-prompts ({self.num_prompts}) must be >= "
                f"--prefix-repetition-num-prefixes ({self.prefix_repetition.num_prefixes})"
            )

    @property
    def endpoint_kind(self) -> EndpointKind:
        return EndpointKind.from_path(self.endpoint)

    @property
    def backend_name(self) -> str:
        return self.backend or self.endpoint_kind.value

    @property
    def api_url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint


def parse_goodput(pairs: list[str] | None) -> tuple[tuple[str, float], ...]:
    """`["ttft:200", "tpot:50"]` -> `(("ttft", 200.0), ("tpot", 50.0))`; names and values checked."""
    parsed: list[tuple[str, float]] = []
    for pair in pairs or ():
        name, sep, value = pair.partition(":")
        try:
            slo = float(value)
        except ValueError:
            slo = math.nan
        if not sep or math.isnan(slo):
            raise ValueError(f'--goodput takes "KEY:VALUE" pairs (VALUE in ms), got {pair!r}')
        if name not in GOODPUT_METRIC_NAMES:
            raise ValueError(f"--goodput metric must be one of {GOODPUT_METRIC_NAMES}, got {name!r}")
        if slo < 0:
            raise ValueError(f"--goodput value must be non-negative, got {pair!r}")
        parsed.append((name, slo))
    return tuple(parsed)


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--metric-percentiles takes comma-separated numbers, got {text!r}") from None


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    sampling = tuple((name, getattr(args, name)) for name in SAMPLING_FIELDS if getattr(args, name) is not None)
    dataset = DatasetName(args.dataset_name)
    return BenchConfig(
        base_url=base_url,
        endpoint=args.endpoint,
        backend=args.backend,
        model=args.model,
        dataset=dataset,
        num_prompts=args.num_prompts,
        random=RandomDatasetConfig(
            input_len=args.random_input_len,
            output_len=args.random_output_len,
            range_ratio=args.random_range_ratio,
            prefix_len=args.random_prefix_len,
            vocab_size=args.random_vocab_size,
        ),
        prefix_repetition=PrefixRepetitionConfig(
            prefix_len=args.prefix_repetition_prefix_len,
            suffix_len=args.prefix_repetition_suffix_len,
            num_prefixes=args.prefix_repetition_num_prefixes,
            output_len=args.prefix_repetition_output_len,
        ),
        custom=CustomDatasetConfig(
            path=Path(args.dataset_path) if args.dataset_path else None,
            output_len=args.custom_output_len,
        ),
        trace=TraceSlice(
            tokens_per_hash=args.trace_tokens_per_hash, time_scale=args.trace_time_scale, start_s=args.trace_start,
            duration_s=args.trace_duration, max_requests=args.trace_max_requests,
            max_output_len=args.trace_max_output_len,
        ),
        dataset_path=Path(args.dataset_path) if args.dataset_path else None,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        ignore_eos=args.ignore_eos if args.ignore_eos is not None else dataset.synthetic,
        sampling=sampling,
        percentile_metrics=tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip()),
        metric_percentiles=parse_percentiles(args.metric_percentiles),
        goodput=parse_goodput(args.goodput),
        metrics_urls=tuple(args.metrics_url or ()),
        disable_tqdm=args.disable_tqdm,
        save_result=args.save_result,
        result_dir=Path(args.result_dir) if args.result_dir else None,
        result_filename=args.result_filename,
        label=args.label,
    )
