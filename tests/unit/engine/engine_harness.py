"""A tiny-preset LLMEngine for unit tests, and helpers to drive it to the end."""

from __future__ import annotations

from pathlib import Path

from hybridpd.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridpd.engine.transfer_params import RemotePrefillParams
from hybridpd.engine.kv_cache.spans import needed_span
from hybridpd.engine.engine import LLMEngine
from hybridpd.engine.request import EngineRequest, RequestOutput
from hybridpd.engine.sampling_params import SamplingParams

MAX_STEPS = 500


def make_engine(model_dir: Path, *, num_blocks: int = 64, budget: int = 2048, max_num_seqs: int = 8,
                max_model_len: int | None = None, cpus: frozenset[int] | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model_dir=model_dir,
        cpus=cpus,
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                  max_model_len=max_model_len),
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
        start, end = needed_span(group.spec, n)
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


def token_ids(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def text(outputs: list[RequestOutput]) -> str:
    return "".join(out.new_text for out in outputs)


def all_free(engine: LLMEngine) -> bool:
    engine.kv.check_invariants()
    return all(engine.kv.num_free_blocks(g) == engine.kv.num_blocks(g) for g in range(len(engine.groups)))
