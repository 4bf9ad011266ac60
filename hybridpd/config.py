"""One frozen config per process, validated in `__post_init__`, passed explicitly."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridpd.tls import TLSConfig

DEFAULT_MAMBA_CACHE_BUDGET = 0.1


class MambaCacheMode(enum.Enum):
    ALIGN = "align"   # save a Mamba state every mamba_cache_interval tokens, so a later request can hit there
    NONE = "none"     # no Mamba prefix hits (so no prefix hits at all in a model with Mamba layers)


class MambaRetentionPolicy(enum.Enum):
    SPARSE = "sparse"   # a few chosen boundaries per request (engine/kv_cache/retention.py)
    EVERY = "every"     # every interval boundary a request crosses (the policy that saves the most states)


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"   # waiting requests in arrival order; a step takes as many prompts as its budget holds
    SJF = "sjf"     # the fewest uncached prompt tokens first, up to a wait; a step stops taking prompts at a size


class KVLoadFailurePolicy(enum.Enum):
    FAIL = "fail"
    RECOMPUTE = "recompute"


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None      # bytes for all groups together; None: use num_blocks or a default
    num_blocks: int | None = None            # explicit block count per attention group
    enable_prefix_caching: bool = True
    mamba_cache_mode: MambaCacheMode = MambaCacheMode.ALIGN
    mamba_cache_interval: int | None = None  # None: the model's mamba_chunk_size rounded up to the block size
    enable_kv_cache_events: bool = False     # record every change of the prefix cache's hits (KV events)
    # Share of the KV memory (after the null blocks and the running Mamba states) for cached Mamba states; the
    # attention groups get the rest (engine/kv_cache/memory.py).
    mamba_cache_budget: float = DEFAULT_MAMBA_CACHE_BUDGET
    mamba_retention: MambaRetentionPolicy = MambaRetentionPolicy.SPARSE
    kv_offload_dir: Path | None = None      # the storage tier's directory (None: no storage tier)
    kv_offload_size: int = 64 << 30         # its capacity in bytes (least recently used files evicted beyond it)
    kv_offload_read_timeout: float = 30.0   # seconds a read from it may take before its request is recomputed
    kv_cache_metrics_sample: float | None = None   # --kv-cache-metrics: the share of blocks followed (None: off)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory must be positive, got {self.kv_cache_memory}")
        if self.kv_offload_size <= 0:
            raise ValueError(f"--kv-offload-size must be positive, got {self.kv_offload_size}")
        if self.kv_cache_metrics_sample is not None and not 0 < self.kv_cache_metrics_sample <= 1:
            raise ValueError(f"--kv-cache-metrics-sample must be in (0, 1], got {self.kv_cache_metrics_sample}")
        if self.kv_offload_read_timeout <= 0:
            raise ValueError(f"--kv-load-timeout must be positive, got {self.kv_offload_read_timeout}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"--num-blocks must be >= 2 (one is the null block), got {self.num_blocks}")
        if not 0 <= self.mamba_cache_budget < 1:
            raise ValueError(f"--mamba-cache-budget is a share of the KV memory in [0, 1), got "
                             f"{self.mamba_cache_budget}")
        if self.mamba_cache_interval is not None and (
            self.mamba_cache_interval < 1 or self.mamba_cache_interval % self.block_size
        ):
            raise ValueError(
                f"--mamba-cache-interval must be a positive multiple of --block-size ({self.block_size}), "
                f"got {self.mamba_cache_interval}"
            )


# 192 rather than 256 since the node became two processes: against vLLM's CPU build it meets the p99 ITL goal on short
# prompts and keeps the mean TTFT goal on 1,024-token ones (benchmarks/README.md, vs_vllm runs 11, 12 and 13).
DEFAULT_PREFILL_TOKENS_WHILE_DECODING = 192


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    # Prefill tokens a step may carry while some request decodes (None: up to max_num_batched_tokens): bounds how
    # long a decoding request waits for its next token when prompts arrive (benchmarks/README.md has the A/B).
    max_prefill_tokens_while_decoding: int | None = DEFAULT_PREFILL_TOKENS_WHILE_DECODING
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    # Under SJF: a request waiting this long goes before shorter ones (in arrival order), so none starves.
    sjf_max_wait: float = 1.0
    # Under SJF: a step takes no further waiting prompt once it carries this many prompt tokens (its prompts all
    # get their first token at its end, so one more only delays the others; the first is not cut by it).
    sjf_step_tokens: int = 256

    def __post_init__(self) -> None:
        if not self.sjf_max_wait > 0:
            raise ValueError(f"--sjf-max-wait must be > 0 seconds, got {self.sjf_max_wait}")
        if self.sjf_step_tokens < 1:
            raise ValueError(f"--sjf-step-tokens must be >= 1, got {self.sjf_step_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_prefill_tokens_while_decoding is not None and self.max_prefill_tokens_while_decoding < 1:
            raise ValueError("--max-prefill-tokens-while-decoding must be >= 1, got "
                             f"{self.max_prefill_tokens_while_decoding}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True, kw_only=True)
class KVTransferConfig:
    kv_host: str = "127.0.0.1"
    kv_port: int = 0                        # gRPC side channel; 0 = HTTP port + 1000
    lease_seconds: float = 60.0
    load_failure_policy: KVLoadFailurePolicy = KVLoadFailurePolicy.FAIL
    decode_skip_mamba_align: bool = True
    load_timeout_seconds: float = 30.0
    cluster_token: str | None = field(default=None, repr=False)
    tls: TLSConfig | None = None            # the side channel's TLS (hybridpd/tls.py)

    def __post_init__(self) -> None:
        if self.lease_seconds <= 0:
            raise ValueError(f"--kv-lease-seconds must be positive, got {self.lease_seconds}")
        if self.load_timeout_seconds <= 0:
            raise ValueError(f"--kv-load-timeout must be positive, got {self.load_timeout_seconds}")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model_dir: Path
    dtype: str = "float32"
    threads: int = 1
    cpus: frozenset[int] | None = None   # the engine thread's CPUs (--engine-cpus); None: wherever the OS puts it
    seed: int = 0
    skip_tokenizer_init: bool = False      # no tokenizer: token ids in and out (engine/tokenizer.py, TokenIdsOnly)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, got {self.dtype}")
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
