"""The simulator's clock: what a step costs on the machine the figures are for.

A prefill costs `prefill_s_per_token` per prompt token computed plus `step_s` per request; a decode step costs
`decode_step_s` (a step's sequences share it: the simulator gives each request that step time per output token, as
continuous batching does while a node is not saturated); a pull costs `pull_s_per_byte` per byte of KV read, and a
read from the storage tier `storage_s_per_byte` per byte (by default what benchmarks/offload_io.py measures of the
tier's loader on the small preset's block files here, ~80 MB/s; it depends on the disk and the page size: give
yours in the JSON). `calibrate` measures the first three on this machine with the real engine on the checkpoint,
one thread, warmed up, and the pull as a memory copy of 256 MiB (the transport's own peak on one host:
benchmarks/transfer.py reads at about that speed). Three terms describe the cluster rather than the model:
`request_s`, what a request waits outside the engine (the proxy's and the nodes' HTTP hops), `cores`, the CPU cores
all nodes share (nodes of one host: a prefill waits for a free core as well as for its node; 0, the default, gives
every node its own), and `request_cpu_s`, the CPU a request takes on those cores outside the engine's steps (node
fronts, the proxy, the transfers, a client on the same host). benchmarks/replay_vs_live.py measures all three on a
live cluster.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_PREFILL_S_PER_TOKEN = 1.0e-3
DEFAULT_STEP_S = 5.0e-3
DEFAULT_DECODE_STEP_S = 1.0e-2
DEFAULT_PULL_S_PER_BYTE = 1.0 / 4e9
DEFAULT_STORAGE_S_PER_BYTE = 1.0 / 8e7   # benchmarks/offload_io.py: ~80 MB/s of the small preset's block files


@dataclass(frozen=True, kw_only=True)
class TimeModel:
    prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN
    step_s: float = DEFAULT_STEP_S
    decode_step_s: float = DEFAULT_DECODE_STEP_S
    pull_s_per_byte: float = DEFAULT_PULL_S_PER_BYTE
    storage_s_per_byte: float = DEFAULT_STORAGE_S_PER_BYTE
    request_s: float = 0.0       # per request, outside the engine: the HTTP hops through the proxy and node fronts
    request_cpu_s: float = 0.0   # per request, the CPU those hops (and the client) take on the shared cores
    cores: int = 0               # CPU cores the whole cluster shares (a prefill takes one); 0: one per node

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if not isinstance(self.cores, int):
            raise ValueError(f"cores must be a whole number, got {self.cores!r}")

    def prefill_s(self, computed_tokens: int) -> float:
        return self.step_s + self.prefill_s_per_token * computed_tokens

    def pull_s(self, num_bytes: int) -> float:
        return self.pull_s_per_byte * num_bytes

    def storage_s(self, num_bytes: int) -> float:
        return self.storage_s_per_byte * num_bytes

    def as_json(self) -> dict[str, float]:
        return asdict(self)


def calibrate(model_dir: Path, prompt_len: int = 512, decode_batch: int = 8, decode_steps: int = 16) -> TimeModel:
    """Measure the step costs of `model_dir` here (real engine, one thread, float32, a warm-up run first)."""
    import torch

    from hybridpd.config import CacheConfig, EngineConfig, SchedulerConfig
    from hybridpd.engine.engine import LLMEngine
    from hybridpd.engine.request import EngineRequest
    from hybridpd.engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model_dir=model_dir, cache=CacheConfig(enable_prefix_caching=False),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=max(2048, prompt_len))))
    generator = torch.Generator().manual_seed(0)

    def run(n: int, length: int, max_tokens: int) -> list[float]:
        for i in range(n):
            ids = tuple(torch.randint(0, 250, (length,), generator=generator).tolist())
            engine.add_request(EngineRequest(request_id=f"c{time.monotonic_ns()}-{i}", prompt_token_ids=ids,
                                             sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                     ignore_eos=True)))
        steps = []
        while engine.has_work():
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
        return steps

    run(1, prompt_len, 2)   # warm-up
    small, large = run(1, 16, 1)[0], run(1, prompt_len, 1)[0]
    per_token = max(0.0, (large - small) / (prompt_len - 16))
    decode = sorted(run(decode_batch, 16, decode_steps)[1:])   # the first step is the batch's prefill
    buffer = torch.empty(256 << 20, dtype=torch.uint8)
    start = time.perf_counter()
    buffer.clone()
    copy_s = time.perf_counter() - start
    return TimeModel(prefill_s_per_token=per_token, step_s=max(0.0, small - 16 * per_token),
                     decode_step_s=decode[len(decode) // 2], pull_s_per_byte=copy_s / (256 << 20))
