"""Continuous batching with chunked prefill, preemption by recompute, and requests that wait for remote KV.

Each step: running requests first (decodes and unfinished prefills, in admission order), then requests whose remote
KV has arrived, then waiting requests, while the token budget, `max_num_seqs` and free blocks allow. While some
request decodes, prefill tokens (unfinished prompts and new ones) also share the smaller
`max_prefill_tokens_while_decoding` budget, so that arriving prompts do not stall every decode for a long step
(raised to the rows the step's products take anyway, `step_rows`: where products pack, a step's rows are rounded up
to a bucket, and the prompt takes those rows instead: +5-10% served throughput on small-vllm, granite-moe and
granite-350m). When a running request cannot get blocks, the most recently admitted running request that is not yet
scheduled this step is preempted (its blocks freed, its tokens recomputed later); if none is left, the request
itself is. A request whose prompt was prefilled remotely gets its blocks allocated, is handed to the loader and
leaves the queues until its KV has arrived: it never blocks others (and does not count against `max_num_seqs`
meanwhile).
A prefill-role request is an ordinary one that ends at its first token with its blocks kept (held under a lease).
A request whose prefix the storage tier extends beyond the memory hit waits the same way for its blocks to be read
(`storage`), then computes the rest of its prompt here.
Waiting requests are admitted in arrival order, or under `--scheduling-policy sjf` the fewest uncached prompt tokens
first with a wait bound, a step taking no further prompt once it carries `sjf_step_tokens` (`waiting_order`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from hybridpd.config import SchedulerConfig, SchedulingPolicy
from hybridpd.engine.kv_cache.coordinator import CacheHit, KVCacheManager, StepBlocks
from hybridpd.engine.kv_offload.tier import LoadItem
from hybridpd.engine.prompt_sources import PromptSources
from hybridpd.engine.request import FinishReason, RequestStatus
from hybridpd.engine.sequence import Sequence
from hybridpd.engine.transfer_params import RemotePrefillParams
from hybridpd.engine.waiting_order import shortest_first


def _decoding(seq: Sequence) -> bool:
    """It needs one token computed to sample its next (a prompt or a recompute after preemption needs more)."""
    return seq.num_tokens - seq.num_computed_tokens <= 1


class _Budget:
    """One step's token budgets: every token, and prefill tokens (a decode's one token is not prefill)."""

    def __init__(self, tokens: int, prefill: int) -> None:
        self.tokens = tokens
        self.prefill = min(prefill, tokens)

    def for_seq(self, seq: Sequence) -> int:
        return self.tokens if _decoding(seq) else self.prefill

    def spend(self, seq: Sequence, num_tokens: int) -> None:
        if not _decoding(seq):
            self.prefill -= num_tokens
        self.tokens -= num_tokens
        self.prefill = min(self.prefill, self.tokens)


class StorageLoads(Protocol):
    def start_load(self, request_id: str, items: list[LoadItem], num_tokens: int) -> None:
        """Begin reading `items` into their blocks (`num_tokens` beyond the memory hit); completion comes back via
        `Scheduler.finish_load`."""


class RemoteKVLoader(Protocol):
    def start_load(self, seq: Sequence, hit_tokens: int, blocks: StepBlocks) -> None:
        """Begin pulling `seq`'s missing KV into `blocks.load`; completion comes back via `Scheduler.finish_load`."""

    def discard(self, seq: Sequence) -> None:
        """`seq` ended before its pull started: let the prefill node free the blocks it holds for it."""

    def release(self, params: RemotePrefillParams) -> None:
        """A request will not pull what `params` name (it computes its prompt here): let its prefill node free it."""


@dataclass(frozen=True)
class _StagedPull:
    blocks: StepBlocks      # every block the remote request needs filled
    rest: StepBlocks        # those the storage tier does not bring
    hit_tokens: int         # the memory hit
    stored_tokens: int      # the memory and storage hit


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    blocks: StepBlocks

    @property
    def prompt_tokens(self) -> int:
        """Of the tokens this step computes for the sequence, those of its prompt."""
        seq = self.seq
        return max(min(seq.num_computed_tokens + self.num_new_tokens, seq.num_prompt_tokens) - seq.num_computed_tokens,
                   0)

    @property
    def samples(self) -> bool:
        """This step brings the sequence level with its tokens, so its last row's logits pick the next token."""
        seq = self.seq
        return seq.num_computed_tokens + self.num_new_tokens == seq.num_tokens


@dataclass(frozen=True)
class SchedulerPlan:
    scheduled: tuple[ScheduledSeq, ...]
    preempted: tuple[Sequence, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        *,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        chunk_boundary: int | None,
        loader: RemoteKVLoader | None = None,
        step_rows: Callable[[int], int] | None = None,
    ) -> None:
        self.config = config
        # the rows a step of n token rows costs as many products as (the model's `product_rows`): the prefill
        # cap while decoding is raised to fill them
        self.step_rows = step_rows
        self.kv = kv
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids  # every one of them stops a request (unless ignore_eos)
        self.chunk_boundary = chunk_boundary  # Mamba align mode: unfinished prefill chunks end on multiples of it
        self.loader = loader
        self.storage: StorageLoads | None = None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: dict[str, Sequence] = {}
        self._load_upto: dict[str, int] = {}   # a storage load: the tokens it brings the request to
        self._then_pull: dict[str, _StagedPull] = {}   # remote requests reading part of their prompt from storage first
        self.loaded: deque[Sequence] = deque()
        self.sources = PromptSources()   # where admitted prompts' tokens came from (vLLM's metrics)
        self.num_preemptions_total = 0
        self._sjf = config.scheduling_policy is SchedulingPolicy.SJF

    # -- queues -------------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.queued_at = time.monotonic()
        if self._sjf and seq.remote_prefill is None:   # (a pulled prompt goes first, whatever its length)
            seq.uncached_estimate = seq.num_prompt_tokens - self._local_hit(seq).num_tokens
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loaded)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading) + len(self.loaded)

    def finish(self, seq: Sequence, reason: FinishReason, status: RequestStatus = RequestStatus.FINISHED) -> None:
        """Take `seq` out of every queue and give its blocks back, except a prefill-role request that produced its
        token: its blocks stay for the lease (`hold`); the engine's hold handler frees them if it leases nothing."""
        for queue in (self.running, self.waiting, self.loaded):
            if seq in queue:
                queue.remove(seq)
        seq.status = status
        seq.finish_reason = reason
        if seq.request_id in self.loading:
            return  # a READ may still be writing into its blocks: `finish_load` frees them once it has stopped
        if seq.remote_prefill is not None and self.loader is not None:
            self.loader.discard(seq)  # ended before its pull: nothing of the prefill node's blocks is needed
            self._drop_remote_prefill(seq)
        if not self.holds(seq):
            self.kv.free(seq.request_id)

    def release_remote(self, params: RemotePrefillParams) -> None:
        """A remotely prefilled request computes its prompt here instead: its prefill node's blocks are let go."""
        if self.loader is not None:
            self.loader.release(params)

    @staticmethod
    def holds(seq: Sequence) -> bool:
        """A prefill-role request that ended with its token (not aborted, not failed) keeps its blocks."""
        return seq.remote_decode and seq.status is RequestStatus.FINISHED and seq.finish_reason in (
            FinishReason.STOP, FinishReason.LENGTH)

    def finish_load(self, request_id: str, ok: bool) -> Sequence | None:
        """The loader is done with `request_id`: on success its whole prompt is in the cache (a storage load: the
        prefix it was asked for; the storage part of a remote request: the pull of the rest starts)."""
        staged = self._then_pull.pop(request_id, None)
        if staged is not None:
            self._pull_after_storage(request_id, ok, staged)
            return None
        seq = self.loading.pop(request_id, None)
        upto = self._load_upto.pop(request_id, None)
        if seq is None:
            return None
        if seq.is_finished:  # aborted or failed while its KV was arriving
            self.kv.free(request_id)
            return None
        if ok:
            seq.num_computed_tokens = seq.num_prompt_tokens if upto is None else upto
            self.kv.commit(seq, seq.num_computed_tokens)
            # From here on the request is an ordinary local one: a preemption recomputes it here.
            self._drop_remote_prefill(seq)
            seq.status = RequestStatus.RUNNING
            self.loaded.append(seq)
        return seq

    def recompute_locally(self, seq: Sequence) -> None:
        """Drop the remote prefill of `seq` (its load failed) and queue it to prefill here."""
        self.kv.free(seq.request_id)
        self._drop_remote_prefill(seq)
        seq.num_computed_tokens = 0
        seq.status = RequestStatus.WAITING
        self.waiting.appendleft(seq)

    @staticmethod
    def _drop_remote_prefill(seq: Sequence) -> None:
        seq.remote_prefill = None
        seq.skip_mamba_align = False

    # -- one step -----------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerPlan:
        while self.loaded and len(self.running) < self.config.max_num_seqs:
            self.running.append(self.loaded.popleft())
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        self.kv.expect_admissions(min(len(self.waiting), self.config.max_num_seqs - len(self.running)))
        budget = _Budget(self.config.max_num_batched_tokens, self._prefill_cap())
        self._schedule_running(budget, scheduled, preempted)
        if not preempted:  # blocks are short: admitting more now would only preempt again
            self._admit_waiting(budget, scheduled)
        return SchedulerPlan(tuple(scheduled), tuple(preempted))

    def _prefill_cap(self) -> int:
        """Prefill tokens this step may carry: all of the budget while nothing decodes, else the cap, raised to the
        rows the step's products multiply anyway (`step_rows`: the products' zero rows filled with prompt tokens)."""
        cap = self.config.max_prefill_tokens_while_decoding
        decoding = sum(1 for seq in self.running if _decoding(seq)) if cap is not None else 0
        if not decoding:
            return self.config.max_num_batched_tokens
        if self.step_rows is None:
            return cap
        return max(cap, self.step_rows(cap + decoding) - decoding)

    def _schedule_running(self, budget: _Budget, scheduled: list[ScheduledSeq], preempted: list[Sequence]) -> None:
        """Give every running request its next tokens, preempting from the tail when blocks run out. A prefill
        that the prefill budget leaves no token this step waits for the next one."""
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            seq = self.running[i]
            num_new = self._num_new_tokens(seq, budget.for_seq(seq))
            if num_new == 0:
                i += 1
                continue
            blocks = self.kv.allocate_slots(seq, num_new)
            while blocks is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
                blocks = self.kv.allocate_slots(seq, num_new)
            if blocks is None:
                break
            scheduled.append(ScheduledSeq(seq, num_new, blocks))
            budget.spend(seq, num_new)
            i += 1

    def _admit_waiting(self, budget: _Budget, scheduled: list[ScheduledSeq]) -> None:
        """Admit waiting requests in order (arrival, or under SJF `waiting_order`'s) while the budgets, `max_num_seqs`
        and free blocks allow; under SJF a prompt computed here also waits while the step is full (`_step_full`)."""
        if self._sjf and len(self.waiting) > 1:
            self.waiting = shortest_first(self.waiting, time.monotonic(), self.config.sjf_max_wait)
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.remote_prefill is not None and self.loader is None:
                self._drop_remote_prefill(seq)  # nothing can pull it: prefill here, with a hit every group serves
            hit = self._local_hit(seq)
            if seq.remote_prefill is not None:
                if not self._start_remote_load(seq, hit):
                    return
                continue
            stored = self.kv.storage_hit(seq, hit) if self.storage is not None and not seq.scores_prompt else 0
            if stored:
                if not self._start_storage_load(seq, hit, stored):
                    return
                continue
            if budget.prefill <= 0 or self._step_full(scheduled):
                return
            item = self._admit_local(seq, hit, budget.prefill)
            if item is None:
                return
            scheduled.append(item)
            budget.spend(seq, item.num_new_tokens)

    def _local_hit(self, seq: Sequence) -> CacheHit:
        """The prefix the local cache holds for `seq` (none while its prompt's logprobs are wanted)."""
        return self.kv.get_computed_blocks(seq) if not seq.scores_prompt else self.kv.no_hit()

    def _step_full(self, scheduled: list[ScheduledSeq]) -> bool:
        """Under SJF: the step carries `sjf_step_tokens` prompt tokens already (a further prompt would only delay
        theirs)."""
        return self._sjf and sum(item.prompt_tokens for item in scheduled) >= self.config.sjf_step_tokens

    def _start_remote_load(self, seq: Sequence, hit: CacheHit) -> bool:
        """Allocate for the remotely prefilled prompt and hand it to the loader; the part of it the storage tier
        holds beyond the memory hit (full-attention blocks, under `skip_mamba_align`), up to what the prefill node
        itself found cached, is read from there first. (What the prefill node computed for this request it may have
        written behind moments ago; that is pulled from it, not read back from the disk.)"""
        external = seq.num_prompt_tokens - hit.num_tokens
        assert seq.remote_prefill is not None
        existed = seq.remote_prefill.remote_cached_tokens or 0
        stored = self.kv.storage_hit(seq, hit, at_most=existed) if self.storage is not None and existed else 0
        blocks = self.kv.allocate_slots(seq, 0, hit, num_external_tokens=external, remote=True)
        if blocks is None:
            return False
        self._park_loading(seq, hit.num_tokens)
        seq.num_cached_tokens = stored or hit.num_tokens
        seq.num_pulled_tokens = seq.num_prompt_tokens - seq.num_cached_tokens
        self._count(seq, hit.num_tokens, pulled=seq.num_pulled_tokens, stored=max(stored - hit.num_tokens, 0))
        assert self.loader is not None
        if not stored:
            self.loader.start_load(seq, hit.num_tokens, blocks)
            return True
        items = self._read_from_storage(seq, blocks, hit.num_tokens, stored)
        taken = {(item.group, item.block_id) for item in items}
        rest = replace(blocks, load=tuple(tuple(pair for pair in loads if (g, pair[1]) not in taken)
                                          for g, loads in enumerate(blocks.load)))
        self._then_pull[seq.request_id] = _StagedPull(blocks, rest, hit.num_tokens, stored)
        return True

    def _pull_after_storage(self, request_id: str, ok: bool, staged: _StagedPull) -> None:
        """The storage part of a remote request is read (or could not be: then the pull brings those blocks too)."""
        seq = self.loading[request_id]
        assert self.loader is not None
        if seq.is_finished:  # aborted while reading from storage: no READ runs, so give everything back now
            del self.loading[request_id]
            if seq.remote_prefill is not None:
                self.loader.discard(seq)
            self.kv.free(request_id)
            return
        if ok:
            self.loader.start_load(seq, staged.stored_tokens, staged.rest)
        else:
            seq.num_cached_tokens = staged.hit_tokens
            seq.num_pulled_tokens = seq.num_prompt_tokens - staged.hit_tokens
            self.loader.start_load(seq, staged.hit_tokens, staged.blocks)

    def _start_storage_load(self, seq: Sequence, hit: CacheHit, upto: int) -> bool:
        """Allocate for the prefix of `upto` tokens and have the storage tier read what memory lacks of it."""
        blocks = self.kv.allocate_slots(seq, 0, hit, num_external_tokens=upto - hit.num_tokens, remote=True)
        if blocks is None:
            return False
        self._park_loading(seq, hit.num_tokens)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = upto
        self._count(seq, hit.num_tokens, stored=upto - hit.num_tokens)
        self._load_upto[seq.request_id] = upto
        self._read_from_storage(seq, blocks, hit.num_tokens, upto)
        return True

    def _count(self, seq: Sequence, local_hit: int, pulled: int = 0, stored: int = 0) -> None:
        """A request admitted for the first time into `sources` (a preempted one again is not, as in vLLM)."""
        if seq.num_preemptions == 0:
            self.sources = self.sources.admitted(seq.num_prompt_tokens, local_hit, pulled=pulled, stored=stored,
                                                 external=self.loader is not None or self.storage is not None,
                                                 looked_up=self.kv.caching)

    def _park_loading(self, seq: Sequence, hit_tokens: int) -> None:
        """`seq` leaves the waiting queue for `loading` (its KV arrives from a loader), computed up to its hit."""
        self._leave_queue(self.waiting.popleft())
        seq.num_computed_tokens = hit_tokens
        seq.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.loading[seq.request_id] = seq

    def _read_from_storage(self, seq: Sequence, blocks: StepBlocks, hit_tokens: int, upto: int) -> list[LoadItem]:
        """Have the storage tier read the blocks of `blocks.load` that a storage hit of `upto` tokens brings."""
        assert self.storage is not None
        items = [LoadItem(*source) for source in self.kv.storage_sources(seq, blocks, upto)]
        self.storage.start_load(seq.request_id, items, upto - hit_tokens)
        return items

    @staticmethod
    def _leave_queue(seq: Sequence) -> None:
        if seq.scheduled_at is None:
            seq.scheduled_at = time.monotonic()

    def _admit_local(self, seq: Sequence, hit: CacheHit, budget: int) -> ScheduledSeq | None:
        """Start prefilling `seq` after its hit."""
        seq.num_computed_tokens = hit.num_tokens
        num_new = self._num_new_tokens(seq, budget)
        blocks = self.kv.allocate_slots(seq, num_new, hit)
        if blocks is None:
            seq.num_computed_tokens = 0
            return None
        self._leave_queue(self.waiting.popleft())
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = hit.num_tokens
        self._count(seq, hit.num_tokens)
        seq.status = RequestStatus.RUNNING
        self.running.append(seq)
        return ScheduledSeq(seq, num_new, blocks)

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_tokens - seq.num_computed_tokens
        num_new = min(remaining, budget)
        if num_new < remaining and self.chunk_boundary:
            end = (seq.num_computed_tokens + num_new) // self.chunk_boundary * self.chunk_boundary
            if end > seq.num_computed_tokens:
                num_new = end - seq.num_computed_tokens
        return num_new

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        seq.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(seq)

    def update(self, plan: SchedulerPlan, sampled: dict[str, int]) -> list[Sequence]:
        """Advance every scheduled sequence; returns those that produced a token."""
        touched = []
        for item in plan.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.kv.commit(seq, seq.num_computed_tokens)
            token = sampled.get(seq.request_id)
            if token is not None:
                seq.append_output(token)
                self._check_length_and_eos(seq)
                touched.append(seq)
        return touched

    def _check_length_and_eos(self, seq: Sequence) -> None:
        reason = self.finish_reason(seq)
        if reason is not None:
            self.finish(seq, reason)

    def finish_reason(self, seq: Sequence) -> FinishReason | None:
        """Why `seq` ends with the token it just got (EOS or a stop token id once past min_tokens, max_tokens, the
        model's length; a prefill-role request ends at its first token), or None. A stop token id is the request's
        `stop_reason`, as in vLLM."""
        last, out, sampling = seq.all_token_ids[-1], seq.num_tokens - seq.num_prompt_tokens, seq.sampling
        if out >= sampling.min_tokens:
            if not sampling.ignore_eos and last in self.eos_token_ids:
                return FinishReason.STOP
            if last in sampling.stop_token_ids:
                seq.stop_reason = last
                return FinishReason.STOP
        if out >= seq.sampling.max_tokens or seq.num_tokens >= self.max_model_len or seq.remote_decode:
            return FinishReason.LENGTH
        return None
