"""Turn a scheduler plan into one forward pass over the paged cache, then sample."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridpd.engine.kv_cache.storage import KVCacheStorage
from hybridpd.engine.model.step.forward_batch import ForwardBatch, SeqEntry, int64_tensor
from hybridpd.engine.model.paged_lm import PagedCausalLM
from hybridpd.engine.logits_processors import TokenHistory
from hybridpd.engine.prompt_logprobs import PromptRows, score_rows
from hybridpd.engine.request import TokenLogprob
from hybridpd.engine.sampling import SampledToken, sample
from hybridpd.engine.scheduler import SchedulerPlan

LogitsHook = Callable[[SchedulerPlan, torch.Tensor], None]


@dataclass(frozen=True)
class RunnerOutput:
    sampled: dict[str, SampledToken]
    # request id -> (the first prompt position scored this step, the logprobs of it and the positions after it)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]]


class ModelRunner:
    def __init__(self, model: PagedCausalLM, storage: KVCacheStorage, logits_hook: LogitsHook | None = None,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.model = model
        self.storage = storage
        self.eos_token_ids = eos_token_ids  # what min_tokens masks (unless a request ignores EOS)
        self.logits_hook = logits_hook  # tests read every step's logits through it

    def build_batch(self, plan: SchedulerPlan) -> tuple[ForwardBatch, list[PromptRows]]:
        """The step's batch; its logits rows are the sampling rows in plan order, then the rows that score prompt
        tokens (`Sequence.scores_prompt`), listed per request in the second value."""
        input_ids: list[int] = []
        positions: list[int] = []
        entries: list[SeqEntry] = []
        logits_rows: list[int] = []
        scoring_rows: list[int] = []
        scored: list[PromptRows] = []
        for item in plan.scheduled:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            if n == 0:
                continue
            first_row = len(input_ids)
            input_ids.extend(seq.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            if item.samples:
                logits_rows.append(len(input_ids) - 1)
            if seq.scores_prompt:  # position p's row predicts the prompt's token at p + 1
                end = min(start + n, seq.num_prompt_tokens - 1)
                if end > start:
                    scoring_rows.extend(range(first_row, first_row + end - start))
                    scored.append(PromptRows(seq.request_id, start + 1, seq.prompt_token_ids[start + 1 : end + 1],
                                             seq.sampling.prompt_logprobs or 0))
            entries.append(
                SeqEntry(
                    num_computed=start,
                    num_new=n,
                    block_tables=item.blocks.block_tables,
                    mamba_saves=tuple(ops.saves if ops is not None else () for ops in item.blocks.mamba),
                    key=f"{seq.request_id}#{seq.arrival_order}.{seq.num_preemptions}",
                )
            )
        batch = ForwardBatch(
            input_ids=int64_tensor(input_ids),
            positions=int64_tensor(positions),
            seqs=tuple(entries),
            logits_indices=int64_tensor(logits_rows + scoring_rows),
        )
        return batch, scored

    def _copy_hit_states(self, plan: SchedulerPlan) -> None:
        for item in plan.scheduled:
            for group_id, ops in enumerate(item.blocks.mamba):
                if ops is not None and ops.copy_from is not None:
                    self.storage.copy_block(group_id, ops.copy_from, ops.state_slot)

    @torch.inference_mode()
    def run(self, plan: SchedulerPlan) -> RunnerOutput:
        self._copy_hit_states(plan)
        batch, scored = self.build_batch(plan)
        if not batch.seqs:
            return RunnerOutput({}, {})
        if scored:
            hidden = self.model.final_hidden(batch, self.storage)
            num_sampling = hidden.shape[0] - sum(len(rows.targets) for rows in scored)
            logits = self.model.logits(hidden[:num_sampling])
            prompt_logprobs = self._score_prompts(hidden[num_sampling:], scored)
        else:
            logits, prompt_logprobs = self.model(batch, self.storage), {}
        if self.logits_hook is not None:
            self.logits_hook(plan, logits)
        samplers = [item for item in plan.scheduled if item.samples]
        histories = [TokenHistory(s.seq.prompt_tensor, s.seq.output_token_ids) if s.seq.sampling.shapes_logits
                     else None for s in samplers]
        tokens = sample(logits, [s.seq.sampling for s in samplers], [s.seq.generator for s in samplers], histories,
                        self.eos_token_ids, [s.seq.grammar for s in samplers])
        return RunnerOutput({s.seq.request_id: t for s, t in zip(samplers, tokens)}, prompt_logprobs)

    def _score_prompts(self, hidden: torch.Tensor,
                       scored: list[PromptRows]) -> dict[str, tuple[int, list[TokenLogprob]]]:
        out = {}
        row = 0
        for rows in scored:
            n = len(rows.targets)
            out[rows.request_id] = (rows.first_target,
                                    score_rows(self.model.logits, hidden[row : row + n], rows.targets, rows.num_top))
            row += n
        return out
