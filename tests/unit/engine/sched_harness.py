"""A scheduler over a real KVCacheManager on tiny specs, with no model: steps sample made-up tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridpd.config import CacheConfig, SchedulerConfig, SchedulingPolicy
from hybridpd.engine.transfer_params import RemoteDecodeParams, RemotePrefillParams
from hybridpd.engine.kv_cache.coordinator import KVCacheManager, StepBlocks
from hybridpd.engine.kv_cache.spec import FullAttentionSpec, KVCacheGroup, KVCacheSpec, MambaSpec, SlidingWindowSpec
from hybridpd.engine.request import EngineRequest
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.scheduler import Scheduler, SchedulerPlan
from hybridpd.engine.sequence import Sequence

EOS = 256
VOCAB = 257
FILLER = 7   # the token every made-up step samples, unless told otherwise
FIRST_TOKEN = 9   # the first token a made-up prefill node sampled


def fa(block_size: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=4, dtype=torch.float32)


def sw(window: int, block_size: int = 4) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=4, dtype=torch.float32,
                             sliding_window=window)


def mamba(interval: int = 8) -> MambaSpec:
    return MambaSpec(block_size=interval, conv_state_shape=(3, 4), ssm_state_shape=(2, 4),
                     dtypes=(torch.float32, torch.float32))


HYBRID = (fa(4), sw(5, 4), mamba(8))


def make_kv(specs: tuple[KVCacheSpec, ...] = HYBRID, blocks: int | tuple[int, ...] = 64) -> KVCacheManager:
    counts = blocks if isinstance(blocks, tuple) else (blocks,) * len(specs)
    groups = tuple(KVCacheGroup(spec=s, layer_ids=(i,)) for i, s in enumerate(specs))
    return KVCacheManager(groups, counts, CacheConfig(block_size=min(s.block_size for s in specs)))


@dataclass
class FakeLoader:
    """Records each `start_load` and `discard`; the test decides when (and whether) a load completes."""

    started: list[tuple[str, int, StepBlocks]] = field(default_factory=list)

    discarded: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)   # the remote request ids of `release`

    def start_load(self, seq: Sequence, hit_tokens: int, blocks: StepBlocks) -> None:
        self.started.append((seq.request_id, hit_tokens, blocks))

    def discard(self, seq: Sequence) -> None:
        self.discarded.append(seq.request_id)

    def release(self, params: RemotePrefillParams) -> None:
        self.released.append(params.remote_request_id)


def make_scheduler(kv: KVCacheManager, *, budget: int = 64, max_num_seqs: int = 8, max_model_len: int = 4096,
                   chunk_boundary: int | None = None, loader: FakeLoader | None = None,
                   prefill_cap: int | None = None, step_rows=None, policy: SchedulingPolicy = SchedulingPolicy.FCFS,
                   step_tokens: int = 256, max_wait: float = 60.0) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                             max_prefill_tokens_while_decoding=prefill_cap, scheduling_policy=policy,
                             sjf_step_tokens=step_tokens, sjf_max_wait=max_wait)
    return Scheduler(config, kv, max_model_len=max_model_len, eos_token_ids=frozenset({EOS}), chunk_boundary=chunk_boundary,
                     loader=loader, step_rows=step_rows)


def prompt(n: int, base: int = 0) -> tuple[int, ...]:
    return tuple((base + 31 * i) % 256 for i in range(n))


_order = iter(range(10**9))


def make_seq(rid: str, n: int, *, max_tokens: int = 4, ignore_eos: bool = True, kv_transfer=None,
             base: int = 0, skip_mamba_align: bool = True) -> Sequence:
    request = EngineRequest(request_id=rid, prompt_token_ids=prompt(n, base),
                            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos),
                            kv_transfer=kv_transfer)
    return Sequence.from_request(request, arrival_order=next(_order), decode_skip_mamba_align=skip_mamba_align,
                                 vocab_size=VOCAB)


def remote_params(n_prompt: int, specs: tuple[KVCacheSpec, ...] = HYBRID) -> RemotePrefillParams:
    """What a prefill node would answer for an `n_prompt`-token prompt (made-up remote block ids)."""
    n = n_prompt
    ids = []
    for spec in specs:
        start, end = spec.needed_span(n)
        ids.append(tuple(range(100, 100 + end - start)))
    return RemotePrefillParams(remote_engine_id="p", remote_request_id="r", remote_block_ids=tuple(ids),
                               remote_host="127.0.0.1", remote_port=7000, remote_num_tokens=n,
                               first_token_id=FIRST_TOKEN)


REMOTE_DECODE = RemoteDecodeParams()


def step(sched: Scheduler, sampled: dict[str, int] | None = None) -> tuple[SchedulerPlan, list[Sequence]]:
    """schedule -> made-up tokens for every sampling row -> update; the pool invariant must hold after it."""
    plan = sched.schedule()
    tokens = {item.seq.request_id: (sampled or {}).get(item.seq.request_id, FILLER)
              for item in plan.scheduled if item.samples}
    touched = sched.update(plan, tokens)
    sched.kv.check_invariants()
    return plan, touched


def all_free(kv: KVCacheManager) -> bool:
    return all(kv.num_free_blocks(g) == kv.num_blocks(g) for g in range(len(kv.groups)))
