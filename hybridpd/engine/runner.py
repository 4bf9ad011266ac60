"""Turn a scheduler plan into one forward pass over the paged cache, then sample."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridpd.engine.kv_cache.storage import KVCacheStorage
from hybridpd.engine.model.step.forward_batch import ForwardBatch, SeqEntry, int64_tensor
from hybridpd.engine.model.paged_lm import PagedCausalLM
from hybridpd.engine.logits_processors import TokenHistory
from hybridpd.engine.sampling import SampledToken, sample
from hybridpd.engine.scheduler import SchedulerPlan

LogitsHook = Callable[[SchedulerPlan, torch.Tensor], None]


@dataclass(frozen=True)
class RunnerOutput:
    sampled: dict[str, SampledToken]


class ModelRunner:
    def __init__(self, model: PagedCausalLM, storage: KVCacheStorage, logits_hook: LogitsHook | None = None,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.model = model
        self.storage = storage
        self.eos_token_ids = eos_token_ids  # what min_tokens masks (unless a request ignores EOS)
        self.logits_hook = logits_hook  # tests read every step's logits through it

    def build_batch(self, plan: SchedulerPlan) -> ForwardBatch:
        input_ids: list[int] = []
        positions: list[int] = []
        entries: list[SeqEntry] = []
        logits_rows: list[int] = []
        for item in plan.scheduled:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            if n == 0:
                continue
            input_ids.extend(seq.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            if item.samples:
                logits_rows.append(len(input_ids) - 1)
            entries.append(
                SeqEntry(
                    num_computed=start,
                    num_new=n,
                    block_tables=item.blocks.block_tables,
                    mamba_saves=tuple(ops.saves if ops is not None else () for ops in item.blocks.mamba),
                    key=f"{seq.request_id}#{seq.arrival_order}.{seq.num_preemptions}",
                )
            )
        return ForwardBatch(
            input_ids=int64_tensor(input_ids),
            positions=int64_tensor(positions),
            seqs=tuple(entries),
            logits_indices=int64_tensor(logits_rows),
        )

    def _copy_hit_states(self, plan: SchedulerPlan) -> None:
        for item in plan.scheduled:
            for group_id, ops in enumerate(item.blocks.mamba):
                if ops is not None and ops.copy_from is not None:
                    self.storage.copy_block(group_id, ops.copy_from, ops.state_slot)

    @torch.inference_mode()
    def run(self, plan: SchedulerPlan) -> RunnerOutput:
        self._copy_hit_states(plan)
        batch = self.build_batch(plan)
        if not batch.seqs:
            return RunnerOutput({})
        logits = self.model(batch, self.storage)
        if self.logits_hook is not None:
            self.logits_hook(plan, logits)
        samplers = [item for item in plan.scheduled if item.samples]
        histories = [TokenHistory(s.seq.prompt_tensor, s.seq.output_token_ids) if s.seq.sampling.shapes_logits
                     else None for s in samplers]
        tokens = sample(logits, [s.seq.sampling for s in samplers], [s.seq.generator for s in samplers], histories,
                        self.eos_token_ids)
        return RunnerOutput({s.seq.request_id: t for s, t in zip(samplers, tokens)})
