"""One node's engine: a model, its paged hybrid KV cache, a scheduler; `step()` is schedule -> run -> update.

Single-threaded: only the engine thread (see async_engine.py) calls into it.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from hybridpd.config import EngineConfig, MambaCacheMode
from hybridpd.engine.transfer_params import RemotePrefillParams
from hybridpd.engine.cache_info import cache_config_info
from hybridpd.engine.detokenizer import Detokenizer
from hybridpd.engine.grammar import Grammar, GrammarCompiler
from hybridpd.engine.histogram import HistogramSnapshot
from hybridpd.engine.kv_cache.coordinator import GroupStats, KVCacheManager
from hybridpd.engine.kv_cache.events import BlockRemoved, BlockStored, KVCacheEvent, Medium
from hybridpd.engine.kv_cache.capacity import capacity_report
from hybridpd.engine.kv_cache.memory import KVLayout, blocks_for_count, layout_for_memory
from hybridpd.engine.kv_cache.residency import Residency
from hybridpd.engine.kv_cache.spec import FullAttentionSpec, KVCacheGroup, group_layers
from hybridpd.engine.kv_cache.storage import KVCacheStorage
from hybridpd.engine.kv_offload.identity import group_key, model_key
from hybridpd.engine.kv_offload.layout import GroupLayout
from hybridpd.engine.kv_offload.store import OffloadStore
from hybridpd.engine.kv_offload.tier import OffloadTier, TierCounters
from hybridpd.engine.model.registry import ModelConfig
from hybridpd.engine.model.generation_config import GenerationDefaults
from hybridpd.engine.model.loader import load_model
from hybridpd.engine.prompt_sources import PromptSources
from hybridpd.engine.request import EngineRequest, FinishReason, RequestOutput, RequestStatus, TokenLogprob
from hybridpd.engine.runner import LogitsHook, ModelRunner, RunnerOutput
from hybridpd.engine.scheduler import RemoteKVLoader, Scheduler, SchedulerPlan
from hybridpd.engine.sequence import Sequence
from hybridpd.engine.step_tokens import NO_STEPS, step_token_counts
from hybridpd.engine.tokenizer import Tokenizer, load_tokenizer
from hybridpd.errors import InvalidRequestError

DEFAULT_KV_CACHE_MEMORY = 512 * 2**20
# Blocks per group whose memory is faulted in ahead of the steps that will write them (kv_cache/prefault.py).
PREFAULT_BLOCKS = 8

log = logging.getLogger(__name__)

# Called with a finished prefill-role sequence (its blocks still held) and its first token's logprobs (when asked);
# returns the top-level kv_transfer_params.
HoldHandler = Callable[[Sequence, TokenLogprob | None], dict]


@dataclass(frozen=True, kw_only=True)
class EngineStats:
    """A snapshot taken on the engine thread, read by the metrics scrape on another thread."""

    num_running: int = 0
    num_waiting: int = 0
    num_loading: int = 0          # KV arriving (a pull or a storage read)
    num_loaded: int = 0           # KV arrived, not running yet
    num_remote_waiting: int = 0   # of the waiting ones, those whose KV a prefill node holds (no pull started)
    kv_usage: float = 0.0
    groups: tuple[GroupStats, ...] = ()
    prompt_tokens: int = 0
    generation_tokens: int = 0
    offload: TierCounters | None = None   # the storage tier's counters, when there is one
    prompt_sources: PromptSources = PromptSources()
    preemptions: int = 0
    step_tokens: HistogramSnapshot = NO_STEPS
    residency: Residency | None = None   # with --kv-cache-metrics
    cache_info: tuple[tuple[str, str], ...] = ()   # vllm:cache_config_info's labels (cache_info.py)


@dataclass
class _Tracked:
    seq: Sequence
    detok: Detokenizer
    sent_tokens: int = 0


def stop_token_ids(model_config: ModelConfig, defaults: GenerationDefaults, tokenizer: Tokenizer) -> frozenset[int]:
    """Every eos id of config.json and generation_config.json, and the tokenizer's own eos token."""
    ids = {*model_config.eos_token_ids, *defaults.eos_token_ids}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def mamba_interval(config: EngineConfig, model_config: ModelConfig) -> int:
    """The Mamba cache interval: `--mamba-cache-interval` (a multiple of the block size, config.py checks), else the
    block size rounded up to a multiple of the model's scan chunk size, where transformers' and vLLM's kernels hold
    their states (ours holds one after every token, so any multiple of the block size serves)."""
    interval = config.cache.mamba_cache_interval
    return math.lcm(config.cache.block_size, model_config.mamba_chunk_size) if interval is None else interval


class LLMEngine:
    def __init__(self, config: EngineConfig, *, logits_hook: LogitsHook | None = None) -> None:
        torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        self.config = config
        dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
        self.model_config, self.model = load_model(config.model_dir, dtype)
        self.model.prepare_kernels()
        self.tokenizer: Tokenizer = load_tokenizer(config.model_dir, self.model_config.vocab_size,
                                                   skip_init=config.skip_tokenizer_init)
        self.generation_defaults = GenerationDefaults.from_model_dir(config.model_dir)
        self.eos_token_ids = stop_token_ids(self.model_config, self.generation_defaults, self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self.max_model_len = config.scheduler.max_model_len or self.model_config.max_position_embeddings
        has_mamba = self.model_config.has_mamba
        self.mamba_interval = mamba_interval(config, self.model_config) if has_mamba else config.cache.block_size
        self.groups: tuple[KVCacheGroup, ...] = group_layers(
            self.model.kv_cache_specs(config.cache.block_size, self.mamba_interval)
        )
        layout = self._layout()
        self.num_blocks = layout.num_blocks
        self.storage = KVCacheStorage(self.groups, self.num_blocks)
        report, self.capacity = capacity_report(self.groups, self.num_blocks, self.max_model_len,
                                                config.scheduler.max_num_seqs, layout.shared)
        for line in report:
            log.info("%s", line)
        self.cache_info = cache_config_info(config.cache, self.capacity, self.mamba_interval if has_mamba else None)
        self.kv = KVCacheManager(self.groups, self.num_blocks, config.cache, shared=layout.shared,
                                 on_release=self.storage.release)
        align = has_mamba and config.cache.mamba_cache_mode is MambaCacheMode.ALIGN
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            chunk_boundary=self.mamba_interval if align and config.cache.enable_prefix_caching else None,
            step_rows=self.model.product_rows,
        )
        self.runner = ModelRunner(self.model, self.storage, logits_hook, eos_token_ids=self.eos_token_ids)
        self.offload = self._storage_tier() if config.cache.kv_offload_dir is not None else None
        self.hold_handler: HoldHandler | None = None
        self.decode_skip_mamba_align = True
        self._tracked: dict[str, _Tracked] = {}
        self._order = itertools.count()
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.step_tokens = step_token_counts()
        self.stats = EngineStats()
        self.refresh_stats()

    def _layout(self) -> KVLayout:
        cache, seqs = self.config.cache, self.config.scheduler.max_num_seqs
        mode = cache.mamba_cache_mode if cache.enable_prefix_caching else MambaCacheMode.NONE
        if cache.num_blocks is not None:
            return KVLayout(blocks_for_count(self.groups, cache.num_blocks, max_num_seqs=seqs, mamba_cache_mode=mode,
                                             mamba_budget=cache.mamba_cache_budget))
        memory = cache.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
        return layout_for_memory(self.groups, memory, max_num_seqs=seqs, mamba_cache_mode=mode,
                                 mamba_budget=cache.mamba_cache_budget, max_model_len=self.max_model_len)

    def _storage_tier(self) -> OffloadTier:
        cache = self.config.cache
        store = OffloadStore(
            cache.kv_offload_dir, model_key(self.config.model_dir, self.config.dtype, cache.block_size),
            tuple(GroupLayout(group_key(i, g), g.page_size_bytes) for i, g in enumerate(self.groups)),
            cache.kv_offload_size, feed=cache.enable_kv_cache_events,
        )
        tier = OffloadTier(store, self.storage.tensors)
        self.kv.use_storage(tier)
        self.scheduler.storage = tier
        log.info("storage tier: %s (%s bytes at most)", store.folder, cache.kv_offload_size)
        return tier

    def storage_events(self) -> list[KVCacheEvent]:
        """The storage tier's changes as KV events (medium DISK): what a request here could now load, or no more."""
        if self.offload is None or not self.config.cache.enable_kv_cache_events:
            return []
        # Per group, its changes in order, each run of one kind one event. The groups' events may go in any order
        # (each applies to its own group), and a file holds several groups' pages: taken in the order they came, a
        # file's groups would alternate and make an event of every page.
        runs: dict[int, list[tuple[bool, list[bytes]]]] = {}
        for held, group, block_hash in self.offload.take_changes():
            group_runs = runs.setdefault(group, [])
            if group_runs and group_runs[-1][0] == held:
                group_runs[-1][1].append(block_hash)
            else:
                group_runs.append((held, [block_hash]))
        return [BlockStored(group_idx=group, block_hashes=tuple(hashes), parent_block_hash=None, token_ids=(),
                            block_size=self.groups[group].spec.block_size, medium=Medium.STORAGE) if held
                else BlockRemoved(group_idx=group, block_hashes=tuple(hashes), medium=Medium.STORAGE)
                for group, group_runs in runs.items() for held, hashes in group_runs]

    def close(self) -> None:
        """Stop the storage tier's threads (its queued writes get a few seconds to reach the disk) and the KV pool's
        prefaulter."""
        if self.offload is not None:
            self.offload.close()
        self.storage.close()

    def set_remote(self, loader: RemoteKVLoader, hold_handler: HoldHandler, decode_skip_mamba_align: bool) -> None:
        self.scheduler.loader = loader
        self.hold_handler = hold_handler
        self.decode_skip_mamba_align = decode_skip_mamba_align

    # -- admission ----------------------------------------------------------------------------------------------
    def validate(self, request: EngineRequest) -> None:
        ids = request.prompt_token_ids
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "prompt")
        if isinstance(request.kv_transfer, RemotePrefillParams):
            self._validate_remote(request.kv_transfer, len(ids))
        total = len(ids) + request.sampling.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request asks for "
                f"{len(ids)} prompt tokens + {request.sampling.max_tokens} max_tokens = {total}",
                "max_tokens",
            )
        self._validate_fits(len(ids), total)

    def _validate_fits(self, num_prompt_tokens: int, total: int) -> None:
        """A request whose full-attention KV (the last sampled token is never computed) exceeds a group's whole
        pool could only preempt itself forever: refuse it up front."""
        for g, group in enumerate(self.groups):
            if not isinstance(group.spec, FullAttentionSpec):
                continue
            need = -(-(total - 1) // group.spec.block_size)
            if need > self.kv.num_blocks(g):
                raise InvalidRequestError(
                    f"the request needs {need} KV blocks for {num_prompt_tokens} prompt tokens + max_tokens, but "
                    f"this node's KV cache has {self.kv.num_blocks(g)} per group", "max_tokens")

    def _validate_remote(self, params: RemotePrefillParams, num_prompt_tokens: int) -> None:
        """The remote prefill must cover exactly this prompt, in this node's group layout, and its first token must
        be one of this vocabulary."""
        field = "kv_transfer_params"
        if params.remote_num_tokens != num_prompt_tokens:
            raise InvalidRequestError(
                f"kv_transfer_params.remote_num_tokens is {params.remote_num_tokens}, but this prompt has "
                f"{num_prompt_tokens} tokens", field)
        vocab = self.model_config.vocab_size
        if params.first_token_id >= vocab:
            raise InvalidRequestError(
                f"kv_transfer_params.first_token_id {params.first_token_id} is outside the vocabulary "
                f"(0..{vocab - 1})", field)
        top = params.first_token_logprob.top if params.first_token_logprob is not None else ()
        bad = next((t for t, _ in top if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"kv_transfer_params.first_token_logprob.top holds token id {bad}, outside the vocabulary "
                f"(0..{vocab - 1})", field)
        if len(params.remote_block_ids) != len(self.groups):
            raise InvalidRequestError(
                f"kv_transfer_params.remote_block_ids has {len(params.remote_block_ids)} groups, this model has "
                f"{len(self.groups)}", field)
        for g, (group, ids) in enumerate(zip(self.groups, params.remote_block_ids)):
            start, end = group.spec.needed_span(params.remote_num_tokens)
            if len(ids) != end - start:
                raise InvalidRequestError(
                    f"kv_transfer_params.remote_block_ids[{g}] has {len(ids)} blocks, a {group.spec.kind} group "
                    f"needs {end - start} for {params.remote_num_tokens} tokens", field)

    def add_request(self, request: EngineRequest) -> RequestOutput | None:
        """Queue `request`. A remotely prefilled one starts with the first token its prefill node sampled: that
        token's output is returned at once (and when it ends the request, the request is done here)."""
        self.validate(request)
        if isinstance(request.kv_transfer, RemotePrefillParams) and request.sampling.prompt_logprobs is not None:
            # a pull brings the prompt's KV, not its logprobs: the prompt is computed here, the prefill node's
            # blocks let go
            self.scheduler.release_remote(request.kv_transfer)
            request = replace(request, kv_transfer=None)
        seq = Sequence.from_request(
            request, arrival_order=next(self._order), decode_skip_mamba_align=self.decode_skip_mamba_align,
            vocab_size=self.model_config.vocab_size, grammar=self._grammar(request),
        )
        self._tracked[seq.request_id] = _Tracked(seq, Detokenizer.of(self.tokenizer, request.sampling))
        self.num_prompt_tokens_total += len(seq.prompt_token_ids)
        self.scheduler.add(seq)
        remote = seq.remote_prefill
        if remote is None:
            return None
        # The hit its admission will take (the same lookup, unless an eviction comes between), so that the first
        # output reports it as every request's first output does.
        seq.num_cached_tokens = self.kv.get_computed_blocks(seq).num_tokens
        reason = self.scheduler.finish_reason(seq)
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return self._emit(seq, remote.first_token_logprob)

    def _grammar(self, request: EngineRequest) -> Grammar | None:
        """A constrained request's matcher, past the first token when another node drew it (under the same
        constraint: a token the constraint does not allow is refused, never followed by masks that cannot match)."""
        constraint = request.sampling.constraint
        if constraint is None:
            return None
        grammar = self.grammars.start(constraint)
        remote = request.kv_transfer
        if isinstance(remote, RemotePrefillParams) and not grammar.accept(remote.first_token_id):
            raise InvalidRequestError(
                f"kv_transfer_params.first_token_id {remote.first_token_id} does not match the request's "
                f"{constraint.field}: its prefill node drew it without the constraint", "kv_transfer_params")
        return grammar

    def request_ids(self) -> list[str]:
        """Every request the engine holds (waiting, loading, running)."""
        return list(self._tracked)

    def abort(self, request_id: str) -> RequestOutput | None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.finish(tracked.seq, FinishReason.ABORT)
        return self._output(tracked, "", (), finished=True)

    def fail(self, request_id: str, error: Exception) -> RequestOutput | None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.finish(tracked.seq, FinishReason.ERROR, RequestStatus.FAILED)
        return self._output(tracked, "", (), finished=True, error=error)

    def complete_load(self, request_id: str) -> None:
        """The remote KV of `request_id` arrived: it joins the running requests and decodes from its first token."""
        self.scheduler.finish_load(request_id, ok=True)

    def fail_load(self, request_id: str, error: Exception, *, recompute: bool) -> RequestOutput | None:
        """The remote KV of `request_id` could not be loaded: fail it, or prefill it here instead."""
        seq = self.scheduler.finish_load(request_id, ok=False)
        if seq is None:
            return None  # it was aborted meanwhile; its blocks are free
        if recompute:
            self.scheduler.recompute_locally(seq)
            return None
        return self.fail(request_id, error)

    def refresh_stats(self) -> None:
        s = self.scheduler
        self.stats = EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting), num_loading=len(s.loading),
            num_loaded=len(s.loaded), num_remote_waiting=sum(seq.remote_prefill is not None for seq in s.waiting),
            kv_usage=self.kv.usage(), groups=self.kv.stats(), prompt_tokens=self.num_prompt_tokens_total,
            generation_tokens=self.num_generation_tokens_total,
            offload=self.offload.snapshot() if self.offload is not None else None,
            prompt_sources=s.sources, preemptions=s.num_preemptions_total, step_tokens=self.step_tokens.snapshot(),
            residency=self.kv.residency.snapshot() if self.kv.residency is not None else None,
            cache_info=self.cache_info,
        )

    def has_work(self) -> bool:
        return self.scheduler.has_work() or (self.offload is not None and self.offload.loading)

    # -- the step -----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.offload is not None:
            self._storage_loads_done()
        plan = self.scheduler.schedule()
        self.storage.prefault_ahead(self.kv.upcoming_blocks(PREFAULT_BLOCKS))
        prompt_tokens = plan.num_prompt_tokens
        out = self.runner.run(plan)
        if plan.scheduled:
            self.step_tokens.observe(prompt_tokens + len(out.sampled))
        self._record_prompt_logprobs(plan, out)
        touched = self.scheduler.update(plan, {rid: s.token_id for rid, s in out.sampled.items()})
        if self.offload is not None:
            self._write_behind()
        return [self._emit(seq, self._logprob(out.sampled.get(seq.request_id))) for seq in touched]

    def _storage_loads_done(self) -> None:
        """Requests whose storage reads finished join the running ones; a failed read (a file gone, torn, foreign)
        or one older than `--kv-load-timeout` (the directory hangs) means computing the prompt here instead. With
        nothing else to do, wait a little for a read."""
        tier = self.offload
        assert tier is not None
        if tier.loading and not self.scheduler.has_work():
            tier.wait_for_load(0.005)
        timeout = self.config.cache.kv_offload_read_timeout
        for request_id in tier.abandon_overdue(timeout):
            log.warning("kv offload: a read for %s took over %g s; its prompt is computed instead", request_id, timeout)
            self.fail_load(request_id, TimeoutError(f"storage tier read timed out after {timeout:g} s"),
                           recompute=True)
        for request_id, ok in tier.take_finished():
            if ok:
                self.complete_load(request_id)
            else:
                self.fail_load(request_id, RuntimeError("storage tier read failed"), recompute=True)

    @staticmethod
    def _record_prompt_logprobs(plan: SchedulerPlan, out: RunnerOutput) -> None:
        for item in plan.scheduled:
            scored = out.prompt_logprobs.get(item.seq.request_id)
            if scored is not None:
                item.seq.record_prompt_logprobs(*scored)

    def _write_behind(self) -> None:
        """Offer the blocks that became hits this step to the tier's write-behind (copies; never waits)."""
        tier = self.offload
        assert tier is not None
        tier.offer(self.kv.take_new_cached())

    @staticmethod
    def _logprob(sampled) -> TokenLogprob | None:
        return sampled.logprob if sampled is not None else None

    def _emit(self, seq: Sequence, logprob: TokenLogprob | None) -> RequestOutput:
        tracked = self._tracked[seq.request_id]
        self.num_generation_tokens_total += 1
        output_ids = seq.output_token_ids  # a copy: made once here
        text_ids = output_ids
        if seq.finish_reason is FinishReason.STOP:  # ended by EOS or a stop token id, which are not part of the text
            text_ids = text_ids[:-1]
        # A prefill-role request ends at its one token (max_tokens) but its output goes on at the decode node: the
        # text is not final there, so what the detokenizer holds back (half a character, the start of a stop
        # string) stays back, as in a colocated stream; the decode node releases it with the tokens after.
        goes_on = seq.remote_decode and seq.finish_reason is FinishReason.LENGTH
        # Stop strings are looked for once the output is past min_tokens, as vLLM does.
        new_text, stop = tracked.detok.step(text_ids, final=seq.is_finished and not goes_on,
                                            match_stops=len(output_ids) > seq.sampling.min_tokens)
        if stop is not None:  # a stop string wins over max_tokens or EOS reached by the same token
            if seq.is_finished:
                seq.finish_reason = FinishReason.STOP
            else:
                self.scheduler.finish(seq, FinishReason.STOP)
            seq.stop_reason = stop
        new_ids = tuple(output_ids[tracked.sent_tokens :])
        tracked.sent_tokens = len(output_ids)
        logprobs = (logprob,) if logprob is not None else ()
        prompt_logprobs = None
        if seq.scores_prompt:  # its first output: the prompt is computed
            prompt_logprobs = (None, *seq.prompt_logprobs)
            seq.prompt_logprobs, seq.prompt_logprobs_sent = [], True
        params = None
        if seq.is_finished:
            self._tracked.pop(seq.request_id, None)
            if self.scheduler.holds(seq):
                params = self._hold(seq, logprob)
        return self._output(tracked, new_text, new_ids, finished=seq.is_finished, logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs, kv_transfer_params=params)

    def _hold(self, seq: Sequence, logprob: TokenLogprob | None) -> dict | None:
        """A prefill-role request computed its prompt and sampled its first token: its blocks stay held under a
        lease for the decode node (freed here when no connector is set up to lease them)."""
        if self.hold_handler is None:
            self.kv.free(seq.request_id)
            return None
        return self.hold_handler(seq, logprob)

    def _output(self, tracked: _Tracked, text: str, ids: tuple[int, ...], *, finished: bool,
                logprobs: tuple[TokenLogprob, ...] = (),
                prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None, error: Exception | None = None,
                kv_transfer_params: dict | None = None) -> RequestOutput:
        seq = tracked.seq
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=ids,
            new_text=text,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_tokens - seq.num_prompt_tokens,
            scheduled_at=seq.scheduled_at,
            num_preemptions=seq.num_preemptions,
            num_pulled_tokens=seq.num_pulled_tokens,
            finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            stop_reason=seq.stop_reason,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            kv_transfer_params=kv_transfer_params,
            error=error,
        )
