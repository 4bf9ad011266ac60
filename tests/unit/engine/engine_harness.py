"""A tiny-preset LLMEngine for unit tests, and helpers to drive it to the end."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridpd.config import CacheConfig, EngineConfig, SchedulerConfig, SchedulingPolicy
from hybridpd.engine.transfer_params import RemotePrefillParams
from hybridpd.engine.engine import LLMEngine
from hybridpd.engine.request import EngineRequest, RequestOutput
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.scheduler import SchedulerPlan
from hybridpd.engine.tokenizer import Tokenizer

from .sched_harness import FakeLoader

MAX_STEPS = 500


def make_engine(model_dir: Path, *, num_blocks: int = 64, budget: int = 2048, max_num_seqs: int = 8,
                max_model_len: int | None = None, cpus: frozenset[int] | None = None,
                policy: SchedulingPolicy = SchedulingPolicy.FCFS) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model_dir=model_dir,
        cpus=cpus,
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                  max_model_len=max_model_len, scheduling_policy=policy, sjf_step_tokens=8),
    ))


def greedy(rid: str, ids: tuple[int, ...], max_tokens: int = 8, **sampling) -> EngineRequest:
    params = {"temperature": 0.0, "ignore_eos": True} | sampling
    return EngineRequest(request_id=rid, prompt_token_ids=ids,
                         sampling=SamplingParams(max_tokens=max_tokens, **params))


def text_prompt(text: str) -> tuple[int, ...]:
    return tuple(text.encode())


def remote_params_for(engine: LLMEngine, n_prompt: int, **changes) -> RemotePrefillParams:
    """What a prefill node would answer for an `n_prompt`-token prompt (made-up remote block ids; first token 5
    unless `first_token_id` says otherwise)."""
    n = n_prompt
    ids = []
    for group in engine.groups:
        start, end = group.spec.needed_span(n)
        ids.append(tuple(range(1, 1 + end - start)))
    fields = dict(remote_engine_id="prefill-0", remote_request_id="remote-r", remote_block_ids=tuple(ids),
                  remote_host="127.0.0.1", remote_port=7000, remote_num_tokens=n, first_token_id=5) | changes
    return RemotePrefillParams(**fields)


def run(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Step until nothing is left to do, checking the pool invariant after every step."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_work():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        engine.kv.check_invariants()
    raise AssertionError("the engine made no progress")


def decode_node(model_dir: Path) -> tuple[LLMEngine, FakeLoader]:
    """An engine set up as a P/D decode node (skip_mamba_align on) whose pulls a FakeLoader takes -> (engine, loader)."""
    engine, loader = make_engine(model_dir), FakeLoader()
    engine.set_remote(loader, hold_handler=lambda seq, logprob: None, decode_skip_mamba_align=True)
    return engine, loader


def decode_remotely(engine: LLMEngine, loader: FakeLoader, request: EngineRequest) -> list[RequestOutput]:
    """`request` (with RemotePrefillParams) on a decode node set up with `loader` (`decode_node`), its pull
    completing at once -> its outputs: the first (the prefill node's token, returned by add_request), then the
    rest."""
    first = engine.add_request(request)
    assert first is not None and not first.finished
    assert engine.step() == [] and [rid for rid, _, _ in loader.started] == [request.request_id]  # admitted: pulls
    engine.complete_load(request.request_id)
    return [first, *run(engine)[request.request_id]]


def token_ids(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def text(outputs: list[RequestOutput]) -> str:
    return "".join(out.new_text for out in outputs)


def finished_text(tokenizer: Tokenizer, ids: list[int]) -> str:
    """An output's text as vLLM's detokenizer leaves it at the end: one decode of its ids, but for last ids that end
    inside a character, which write nothing (the longest prefix whose decode does not end in U+FFFD)."""
    whole = max(k for k in range(len(ids) + 1) if k == 0 or not tokenizer.decode(ids[:k]).endswith("\ufffd"))
    return tokenizer.decode(ids[:whole])


def all_free(engine: LLMEngine) -> bool:
    engine.kv.check_invariants()
    return all(engine.kv.num_free_blocks(g) == engine.kv.num_blocks(g) for g in range(len(engine.groups)))


def make_recording_engine(model_dir: Path, *, num_blocks: int, budget: int,
                          dtype: str = "float32") -> tuple[LLMEngine, list]:
    """Block size 4, up to 4 sequences; the list gets, per sampling step, each request's logits row."""
    rows: list = []

    def record(plan: SchedulerPlan, logits: torch.Tensor) -> None:
        samplers = [item for item in plan.scheduled if item.samples]
        rows.append({item.seq.request_id: row.clone() for item, row in zip(samplers, logits)})

    engine = LLMEngine(EngineConfig(
        model_dir=model_dir, dtype=dtype, cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4),
    ), logits_hook=record)
    return engine, rows


def drive(engine: LLMEngine, arrivals: dict[int, list]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Steps the engine, adding arrivals[k] before step k, until it has nothing left (checking the cache's
    invariants after every step) -> each request's token ids and its reported cached tokens."""
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    step = 0
    while engine.has_work() or any(k >= step for k in arrivals):
        for request in arrivals.get(step, []):
            engine.add_request(request)
            outputs[request.request_id] = []
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
        engine.kv.check_invariants()
        step += 1
    return outputs, cached


def prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist())
