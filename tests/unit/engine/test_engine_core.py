"""LLMEngine on the tiny preset: admission errors, stop strings, abort, load failures, the prefill role.

Every scenario ends with the pool invariant checked and every block free.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from hybridpd.config import SchedulingPolicy
from hybridpd.engine.engine import PREFAULT_BLOCKS
from hybridpd.engine.kv_cache.prefault import REGION_BYTES
from hybridpd.engine.transfer_params import RemoteDecodeParams
from hybridpd.engine.metrics import EngineCollector
from hybridpd.engine.request import EngineRequest, FinishReason, RequestStatus
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.errors import InvalidRequestError, KVTransferError

from .engine_harness import all_free, greedy, make_engine, remote_params_for, run, text, text_prompt, token_ids
from .sched_harness import FakeLoader

PROMPT = text_prompt("The quick brown fox jumps over")   # 30 tokens


@pytest.fixture
def engine(tiny_dir):
    return make_engine(tiny_dir, max_model_len=128)


def with_remote(engine, n_prompt: int, **changes) -> EngineRequest:
    return EngineRequest(request_id="r", prompt_token_ids=PROMPT[:n_prompt],
                         sampling=SamplingParams(max_tokens=4, temperature=0.0),
                         kv_transfer=remote_params_for(engine, n_prompt, **changes))


@pytest.mark.parametrize("make_request, field, message", [
    (lambda e: greedy("a", ()), "prompt", "empty"),
    (lambda e: greedy("a", (1, 2, e.model_config.vocab_size)), "prompt", "outside the vocabulary"),
    (lambda e: greedy("a", (-1, 2)), "prompt", "outside the vocabulary"),
    (lambda e: greedy("a", (1,) * 120, max_tokens=9), "max_tokens", "maximum context length is 128"),
    (lambda e: greedy("a", (1,) * 129, max_tokens=1), "max_tokens", "maximum context length"),
    (lambda e: with_remote(e, 20, remote_num_tokens=19), "kv_transfer_params", "remote_num_tokens is 19"),
    (lambda e: with_remote(e, 20, remote_num_tokens=5), "kv_transfer_params", "this prompt has 20 tokens"),
    (lambda e: with_remote(e, 20, first_token_id=e.model_config.vocab_size), "kv_transfer_params",
     "first_token_id 320 is outside the vocabulary"),
    (lambda e: with_remote(e, 20, remote_block_ids=((1,),) * 4), "kv_transfer_params", "has 4 groups"),
    (lambda e: with_remote(e, 20, remote_block_ids=((1, 2, 3, 4, 5, 6),) * 5), "kv_transfer_params",
     "remote_block_ids[0] has 6 blocks"),
    (lambda e: with_remote(e, 20, remote_block_ids=((1,), (1, 2, 3, 4), (1, 2), (1, 2, 3, 4, 5), (1, 2, 3, 4, 5))),
     "kv_transfer_params", "remote_block_ids[1] has 4 blocks"),
])
def test_validate_rejects(engine, make_request, field, message):
    with pytest.raises(InvalidRequestError, match=message.replace("[", r"\[")) as caught:
        engine.validate(make_request(engine))
    assert caught.value.param == field
    with pytest.raises(InvalidRequestError):
        engine.add_request(make_request(engine))
    assert not engine.has_work() and all_free(engine)


@pytest.mark.parametrize("n_prompt", [1, 2, 20, 30])
def test_validate_accepts_what_a_prefill_node_answers(engine, n_prompt):
    engine.validate(with_remote(engine, n_prompt))


def test_a_request_larger_than_the_kv_cache_is_refused(tiny_dir):
    small = make_engine(tiny_dir, num_blocks=6)      # 5 usable blocks of 4 tokens: 20 cached tokens
    small.validate(greedy("a", (1,) * 17, max_tokens=4))
    with pytest.raises(InvalidRequestError, match="KV blocks") as caught:
        small.validate(greedy("a", (1,) * 17, max_tokens=5))
    assert caught.value.param == "max_tokens"


@pytest.fixture
def reference(tiny_dir):
    """The greedy text and ids of PROMPT with no stop string."""
    engine = make_engine(tiny_dir)
    engine.add_request(greedy("ref", PROMPT, max_tokens=24))
    outputs = run(engine)["ref"]
    full = engine.tokenizer.decode(token_ids(outputs))
    return token_ids(outputs), full


def stop_candidates(ids, full, tokenizer):
    """Two-character substrings of the greedy output, each with the number of tokens it takes to complete it."""
    out = []
    for k in range(2, len(full) - 2, 3):
        stop = full[k:k + 2]
        if "\ufffd" in stop or stop in full[:k]:
            continue
        needed = next(i for i in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:i]))
        out.append((stop, needed))
    return out


@pytest.mark.parametrize("max_tokens_from_stop", [+5, 0])   # stop before max_tokens, or on the very last token
def test_stop_strings_end_the_request(tiny_dir, reference, max_tokens_from_stop):
    ids, full = reference
    engine = make_engine(tiny_dir)
    candidates = stop_candidates(ids, full, engine.tokenizer)
    assert candidates, full
    for i, (stop, needed) in enumerate(candidates[:3]):
        engine.add_request(greedy(f"s{i}", PROMPT, max_tokens=needed + max_tokens_from_stop, stop=("\x00\x00", stop)))
        outputs = run(engine)[f"s{i}"]
        last = outputs[-1]
        assert last.finished and last.finish_reason is FinishReason.STOP and last.stop_reason == stop
        assert text(outputs) == full[: full.index(stop)]
        assert token_ids(outputs) == ids[:needed]
        assert sum(out.finished for out in outputs) == 1
    assert all_free(engine)


def test_abort_frees_blocks_and_ends_the_request(engine):
    engine.add_request(greedy("a", PROMPT, max_tokens=20))
    engine.add_request(greedy("b", PROMPT[:10], max_tokens=20))
    for _ in range(3):
        engine.step()
    out = engine.abort("a")
    assert out is not None and out.finished and out.finish_reason is FinishReason.ABORT
    assert engine.kv.block_table("a") == ((),) * len(engine.groups)
    assert engine.abort("a") is None and engine.abort("never") is None
    outputs = run(engine)
    assert set(outputs) == {"b"} and outputs["b"][-1].finish_reason is FinishReason.LENGTH
    assert all_free(engine)


def test_abort_of_a_waiting_request(engine):
    engine.add_request(greedy("a", PROMPT))
    assert engine.abort("a").finish_reason is FinishReason.ABORT
    assert not engine.has_work() and all_free(engine)


@pytest.fixture
def remote_engine(tiny_dir):
    engine = make_engine(tiny_dir)
    loader = FakeLoader()
    engine.set_remote(loader, hold_handler=lambda seq, logprob: {"held": seq.request_id},
                      decode_skip_mamba_align=True)
    return engine, loader


def colocated_tokens(tiny_dir, n_prompt: int, max_tokens: int) -> list[int]:
    engine = make_engine(tiny_dir)
    engine.add_request(greedy("c", PROMPT[:n_prompt], max_tokens=max_tokens, ignore_eos=False))
    return token_ids(run(engine)["c"])


@pytest.mark.parametrize("n_prompt", [1, 2, 21, 30])
def test_fail_load_with_recompute_produces_the_colocated_tokens(tiny_dir, remote_engine, n_prompt):
    engine, loader = remote_engine
    expected = colocated_tokens(tiny_dir, n_prompt, 4)
    first = engine.add_request(with_remote(engine, n_prompt, first_token_id=expected[0]))
    assert first.new_token_ids == (expected[0],) and not first.finished     # streamed before any step
    assert run(engine) == {}
    assert [rid for rid, _, _ in loader.started] == ["r"]
    assert engine.fail_load("r", KVTransferError("p:1", "boom"), recompute=True) is None
    outputs = [first, *run(engine)["r"]]
    assert token_ids(outputs) == expected
    assert outputs[-1].finished and outputs[-1].error is None
    assert all_free(engine)


def test_fail_load_without_recompute_fails_the_request(remote_engine):
    engine, loader = remote_engine
    engine.add_request(with_remote(engine, 20))
    run(engine)
    error = KVTransferError("p:1", "boom")
    out = engine.fail_load("r", error, recompute=False)
    assert out.finished and out.finish_reason is FinishReason.ERROR and out.error is error
    assert not engine.has_work() and engine.scheduler.num_unfinished() == 0
    assert all_free(engine)


@pytest.mark.parametrize("ok", [True, False])
def test_abort_while_loading_frees_once_the_load_stops(remote_engine, ok):
    engine, _ = remote_engine
    engine.add_request(with_remote(engine, 20))
    run(engine)
    assert engine.abort("r").finish_reason is FinishReason.ABORT
    assert not all_free(engine)                       # the READ may still be writing
    if ok:
        engine.complete_load("r")
    else:
        assert engine.fail_load("r", KVTransferError("p:1", "x"), recompute=True) is None
    assert engine.scheduler.num_unfinished() == 0 and all_free(engine)


@pytest.mark.parametrize("n_prompt, handler", [(20, True), (1, True), (20, False)])
def test_prefill_role_holds_its_blocks_for_the_handler(tiny_dir, n_prompt, handler):
    engine = make_engine(tiny_dir)
    held = []
    if handler:
        engine.set_remote(FakeLoader(), hold_handler=lambda seq, logprob: held.append((seq, logprob)) or {
            "n": seq.num_prompt_tokens}, decode_skip_mamba_align=True)
    engine.add_request(EngineRequest(request_id="p", prompt_token_ids=PROMPT[:n_prompt],
                                     sampling=SamplingParams(max_tokens=5, temperature=0.0, logprobs=2),
                                     kv_transfer=RemoteDecodeParams()))
    out, = run(engine)["p"]
    expected = colocated_tokens(tiny_dir, n_prompt, 1)
    assert out.finished and out.new_token_ids == tuple(expected) and out.num_output_tokens == 1
    assert out.finish_reason is FinishReason.LENGTH and out.logprobs[0].token_id == expected[0]
    if handler:
        assert out.kv_transfer_params == {"n": n_prompt}
        seq, logprob = held[0]
        assert logprob == out.logprobs[0]
        assert seq.num_computed_tokens == n_prompt and seq.status is RequestStatus.FINISHED
        assert not all_free(engine)                   # held: the lease decides when they go
        engine.kv.free("p")
    else:
        assert out.kv_transfer_params is None
    assert all_free(engine)


@pytest.mark.parametrize("stop", [(), ("~~~~~~~~",), ("~~",)])
def test_prefill_role_text_is_a_streams_first_chunk(tiny_dir, stop):
    """Its output goes on at the decode node, so its text is what a colocated stream sends first: what the
    detokenizer holds back (half a character: this prompt's first token is one; the start of a stop string) stays
    back (the client's stream may start with it: the proxy's head)."""
    colocated = make_engine(tiny_dir)
    colocated.add_request(greedy("c", PROMPT, max_tokens=4, stop=stop))
    first_chunk = run(colocated)["c"][0]
    engine = make_engine(tiny_dir)
    engine.add_request(EngineRequest(request_id="p", prompt_token_ids=PROMPT,
                                     sampling=SamplingParams(max_tokens=1, temperature=0.0, stop=stop),
                                     kv_transfer=RemoteDecodeParams()))
    out, = run(engine)["p"]
    assert out.finished and out.new_token_ids == first_chunk.new_token_ids
    assert out.new_text == first_chunk.new_text
    assert all_free(engine)


def test_metrics_collector_reads_the_snapshot(engine):
    registry = CollectorRegistry()
    EngineCollector(engine).register(registry)
    engine.add_request(greedy("a", PROMPT, max_tokens=3))
    engine.step()
    engine.refresh_stats()
    assert registry.get_sample_value("vllm:num_requests_running", {"model_name": "model", "engine": "0"}) == 1
    assert registry.get_sample_value("hybridpd:engine_prompt_tokens_total") == len(PROMPT)
    total = registry.get_sample_value("hybridpd:kv_total_blocks", {"group": "1", "kind": "full_attention"})
    free = registry.get_sample_value("hybridpd:kv_free_blocks", {"group": "1", "kind": "full_attention"})
    assert total == 63 and free == 63 - 8             # 31 tokens in the cache: 8 blocks of 4
    run(engine)
    engine.refresh_stats()
    assert registry.get_sample_value("vllm:num_requests_running", {"model_name": "model", "engine": "0"}) == 0
    assert registry.get_sample_value("hybridpd:engine_generation_tokens_total") == 3
    assert all_free(engine)


def test_a_step_has_the_memory_of_the_next_blocks_faulted_in_ahead(engine):
    engine.add_request(greedy("a", text_prompt("hello there"), max_tokens=2))
    engine.step()
    storage = engine.storage
    storage.prefaulter.wait_idle()
    if not storage.prefaulter.supported:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    upcoming = engine.kv.upcoming_blocks(PREFAULT_BLOCKS)
    assert any(upcoming) and storage.prefaulter.populated_bytes > 0
    for group, blocks in enumerate(upcoming):
        page = engine.groups[group].page_size_bytes
        base = storage.tensors[group].data_ptr()
        regions = {(base + b * page) // REGION_BYTES for b in blocks}
        assert regions <= storage._populated[group]
    run(engine)
    engine.close()
    assert storage.prefaulter._thread is None   # stopped


def test_shortest_job_first_changes_the_order_not_the_tokens(tiny_dir):
    """A burst of prompts (two of them sharing a prefix) under sjf, steps of 8 prompt tokens: the short ones get
    their first token in an earlier step than the long ones (under fcfs all in the first), every request's tokens
    are fcfs's, and every block is back at the end."""
    burst = [greedy("long", PROMPT, max_tokens=6), greedy("mid", PROMPT[:14], max_tokens=6),
             greedy("short", PROMPT[5:9], max_tokens=6), greedy("again", PROMPT[:29], max_tokens=6)]
    first_step, tokens = {}, {}
    for policy in (SchedulingPolicy.FCFS, SchedulingPolicy.SJF):
        engine = make_engine(tiny_dir, max_model_len=128, policy=policy)
        for request in burst:
            engine.add_request(request)
        steps, outputs = 0, {}
        while engine.has_work():
            steps += 1
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)
                first_step.setdefault((policy, out.request_id), steps)
            engine.kv.check_invariants()
        tokens[policy] = {rid: token_ids(outs) for rid, outs in outputs.items()}
        assert all_free(engine)
    assert tokens[SchedulingPolicy.SJF] == tokens[SchedulingPolicy.FCFS]
    assert [first_step[(SchedulingPolicy.FCFS, rid)] for rid in ("long", "mid", "short", "again")] == [1, 1, 1, 1]
    # the step takes "short" (4 tokens) and then "mid" (14: 4 < 8, the step's size); the two long ones wait
    assert [first_step[(SchedulingPolicy.SJF, rid)] for rid in ("short", "mid")] == [1, 1]
    assert min(first_step[(SchedulingPolicy.SJF, rid)] for rid in ("long", "again")) > 1
