"""The cache-aware choice on tiny indexes: the cost rule of proxy/cache_aware.py, table-driven."""

from __future__ import annotations

import re

import pytest

from hybridpd.engine.kv_cache.hashing import RequestBlockHashes
from hybridpd.kv_events import wire
from hybridpd.kv_events.wire import GroupInfo
from hybridpd.proxy.cache_aware import (
    cache_salt, choose, choose_decode_alone, token_ids_in_body, tokenize_body, truncated,
)
from hybridpd.proxy.config import CostRule, Role, RoutingPolicy, Upstream
from hybridpd.proxy.kv_index import NodeIndex, PromptHashes
from hybridpd.proxy.routing import Router
from hybridpd.proxy.upstream import DecodeStream, InFlightCall

B = 4
GROUPS = (GroupInfo(group_idx=0, kind="full_attention", block_size=B, sliding_window=None),
          GroupInfo(group_idx=1, kind="mamba", block_size=2 * B, sliding_window=None))
PROMPT = list(range(1, 34))   # 33 tokens: hits are capped at 32


def _node(port: int) -> Upstream:
    return Upstream(role=Role.DECODE, host="127.0.0.1", port=port)


def _index_holding(tokens: list[int], mamba_upto: int | None = None, medium: str = "GPU") -> NodeIndex:
    index = NodeIndex(GROUPS)
    hashes = RequestBlockHashes(None)
    fa = hashes.chain(B, tokens)
    events: list = [wire.BlockStored(block_hashes=fa, parent_block_hash=None, token_ids=tokens[: len(fa) * B],
                                     block_size=B, lora_id=None, medium=medium, lora_name=None, group_idx=0)]
    if mamba_upto:
        state = hashes.chain(2 * B, tokens)[mamba_upto // (2 * B) - 1]
        events.append(wire.BlockStored(block_hashes=[state], parent_block_hash=None, token_ids=[], block_size=2 * B,
                                       lora_id=None, medium="GPU", lora_name=None, group_idx=1))
    index.apply(events)
    return index


@pytest.mark.parametrize("held, role, expected", [
    (PROMPT[:20], Role.DECODE, 20),          # full attention alone decides a decode node's hit
    (PROMPT[:20], Role.PREFILL, 0),          # no Mamba state: no hybrid hit
    (PROMPT, Role.DECODE, 32),               # capped at prompt length - 1
])
def test_predicted_hits(held, role, expected):
    router = Router((_node(1),), RoutingPolicy.CACHE_AWARE)
    choice = choose(router, role, PromptHashes(PROMPT, None), lambda u: _index_holding(held), CostRule())
    assert choice.predicted_hit == expected and choice.work_tokens == len(PROMPT) - expected


def test_storage_blocks_count_apart_from_memory_and_weigh_half():
    index = _index_holding(PROMPT[:24], medium="DISK")
    index.apply([wire.AllBlocksCleared()])   # a reset of the memory pool leaves the storage tier's files
    prompt = PromptHashes(PROMPT, None)
    assert index.decode_hit(prompt) == 0 and index.decode_hit(prompt, with_storage=True) == 24
    reader, other = _node(1), _node(2)
    router = Router((reader, other), RoutingPolicy.CACHE_AWARE)
    indexes = {reader: index, other: NodeIndex(GROUPS)}
    choice = choose(router, Role.DECODE, prompt, indexes.get, CostRule())
    assert choice.upstream == reader and choice.predicted_hit == 0   # 33 - 0.5 x 24 < 33
    with router.in_flight(reader, work_tokens=1):   # one call in flight (32 tokens of load) outweighs 12 saved
        assert choose(router, Role.DECODE, prompt, indexes.get, CostRule()).upstream == other
    removal = wire.BlockRemoved(block_hashes=RequestBlockHashes(None).chain(B, PROMPT)[:1], medium="DISK",
                                group_idx=0)
    index.apply([removal])
    assert index.decode_hit(prompt, with_storage=True) == 0


def test_prefill_hit_needs_a_mamba_state_at_the_hit():
    router = Router((_node(1),), RoutingPolicy.CACHE_AWARE)
    choice = choose(router, Role.PREFILL, PromptHashes(PROMPT, None), lambda u: _index_holding(PROMPT, 16), CostRule())
    assert choice.predicted_hit == 16


@pytest.mark.parametrize("threshold, held, mamba_upto, medium, expected_hit", [
    (0, PROMPT, 32, "GPU", None),      # off: every request is disaggregated
    (2, PROMPT, 32, "GPU", 32),        # 1 token to compute < 2: the decode node serves it whole
    (1, PROMPT, 32, "GPU", None),      # 1 is not below 1
    (16, PROMPT, 24, "GPU", 24),       # the hybrid hit ends at the Mamba state: 9 to compute < 16
    (9, PROMPT, 24, "GPU", None),      # ...not < 9
    (32, PROMPT, None, "GPU", None),   # full attention alone is no hit for a prompt computed here: 33 to compute
    (2, PROMPT, 32, "DISK", 32),       # what its storage tier holds counts (read, not computed)
    (40, [], None, "GPU", 0),          # a threshold above the prompt: whole prompts are served whole
])
def test_a_decode_node_serves_alone_what_it_would_compute_little_of(threshold, held, mamba_upto, medium,
                                                                    expected_hit):
    node = _node(1)
    router = Router((node,), RoutingPolicy.CACHE_AWARE)
    index = _index_holding(held, mamba_upto, medium) if held else NodeIndex(GROUPS)
    choice = choose_decode_alone(router, PromptHashes(PROMPT, None), lambda u: index, CostRule(pd_threshold=threshold))
    if expected_hit is None:
        assert choice is None
    else:
        assert choice is not None and choice.upstream == node
        assert (choice.predicted_hit, choice.work_tokens) == (expected_hit, len(PROMPT) - expected_hit)


def test_a_decode_node_without_an_index_never_serves_alone():
    router = Router((_node(1),), RoutingPolicy.CACHE_AWARE)
    assert choose_decode_alone(router, PromptHashes(PROMPT, None), lambda u: None, CostRule(pd_threshold=64)) is None


def test_the_decode_node_chosen_to_serve_alone_is_the_cost_rules():
    """Both nodes hold the prompt; the one with calls in flight loses, and it is the other's miss that counts."""
    busy, idle = _node(1), _node(2)
    router = Router((busy, idle), RoutingPolicy.CACHE_AWARE)
    indexes = {busy: _index_holding(PROMPT, 32), idle: _index_holding(PROMPT, 16)}
    rule = CostRule(pd_threshold=20)
    with router.in_flight(busy, work_tokens=8), router.in_flight(busy, work_tokens=8):
        choice = choose_decode_alone(router, PromptHashes(PROMPT, None), indexes.get, rule)
    assert choice is not None and (choice.upstream, choice.predicted_hit) == (idle, 16)


@pytest.mark.parametrize("in_flight_on_holder, work_per_call, load_per_request, weight, expected_port", [
    (0, 1, 32, 1.0, 1),     # the holder wins: 1 vs 33
    (3, 1, 8, 1.0, 1),      # calls in flight that cost less than the hit saves keep it there: 1 + 3 + 24 = 28 < 33
    (4, 1, 8, 1.0, 2),      # ...one more and the prefix spreads: 1 + 4 + 32 = 37 > 33
    (1, 1, 64, 1.0, 2),     # one call that costs more than the hit saves: 1 + 1 + 64 > 33
    (1, 40, 0, 1.0, 2),     # one queued miss of 40 tokens, counted whole: 1 + 40 > 33
    (1, 40, 0, 0.5, 1),     # ...counted half (the default): 1 + 20 < 33, the holder keeps the prompt
    (1, 80, 0, 0.5, 2),     # a queued miss twice the size spreads it even so: 1 + 40 > 33
    (9, 1, 0, 0.0, 1),      # weight 0, no load per call: the hit alone decides
])
def test_a_hot_prefix_spreads_once_its_node_is_busy(in_flight_on_holder, work_per_call, load_per_request, weight,
                                                    expected_port):
    holder, other = _node(1), _node(2)
    router = Router((holder, other), RoutingPolicy.CACHE_AWARE)
    indexes = {holder: _index_holding(PROMPT), other: NodeIndex(GROUPS)}
    prompt = PromptHashes(PROMPT, None)
    rule = CostRule(load_tokens_per_request=load_per_request, queued_tokens_weight=weight)
    contexts = [router.in_flight(holder, work_tokens=work_per_call) for _ in range(in_flight_on_holder)]
    for c in contexts:
        c.__enter__()
    try:
        # holder: 1 miss + n * (weight * queued + load);  other: 33 misses
        assert choose(router, Role.DECODE, prompt, indexes.get, rule).upstream.port == expected_port
    finally:
        for c in contexts:
            c.__exit__(None, None, None)


@pytest.mark.parametrize("load, weight, message", [
    (-1, 0.5, "--load-tokens-per-request must be >= 0"),
    (32, 1.5, "--queued-tokens-weight must be in [0, 1]"),
    (32, -0.1, "--queued-tokens-weight must be in [0, 1]"),
])
def test_a_cost_rule_out_of_range_is_refused(load, weight, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        CostRule(load_tokens_per_request=load, queued_tokens_weight=weight)
    with pytest.raises(ValueError, match=re.escape("--pd-threshold must be >= 0")):
        CostRule(pd_threshold=-1)


def test_without_any_index_it_is_least_outstanding_work():
    a, b = _node(1), _node(2)
    router = Router((a, b), RoutingPolicy.CACHE_AWARE)
    with router.in_flight(a, work_tokens=100):
        assert choose(router, Role.DECODE, PromptHashes(PROMPT, None), lambda u: None, CostRule()).upstream == b


def test_a_salted_prompt_does_not_hit_unsalted_blocks():
    router = Router((_node(1),), RoutingPolicy.CACHE_AWARE)
    choice = choose(router, Role.DECODE, PromptHashes(PROMPT, b"tenant"), lambda u: _index_holding(PROMPT), CostRule())
    assert choice.predicted_hit == 0


@pytest.mark.parametrize("path, body, ids, tokenize", [
    ("/v1/completions", {"prompt": [5, 6]}, [5, 6], None),
    ("/v1/completions", {"prompt": [[5, 6]]}, [5, 6], None),
    ("/v1/completions", {"prompt": "hi", "model": "m"}, None, {"prompt": "hi", "model": "m"}),
    ("/v1/completions", {"prompt": ["hi"]}, None, {"prompt": "hi"}),
    ("/v1/completions", {"prompt": ""}, None, None),
    ("/v1/completions", {"prompt": [True, 1]}, None, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, None,
     {"messages": [{"role": "user", "content": "x"}]}),
    ("/v1/chat/completions", {"messages": "nope"}, None, None),
    ("/v1/completions", {"prompt": "hi", "add_special_tokens": False, "add_generation_prompt": False}, None,
     {"prompt": "hi", "add_special_tokens": False}),
    ("/v1/chat/completions", {"messages": [], "add_generation_prompt": False, "add_special_tokens": "x"}, None,
     {"messages": [], "add_generation_prompt": False}),
    ("/v1/chat/completions", {"messages": [], "chat_template_kwargs": {"thinking": True}}, None,
     {"messages": [], "chat_template_kwargs": {"thinking": True}}),
    ("/v1/chat/completions", {"messages": [], "chat_template": "{{ x }}", "max_tokens": 3}, None,
     {"messages": [], "chat_template": "{{ x }}"}),
    # a Responses body: the chat body it asks for, its tools in chat's shape
    ("/v1/responses", {"input": "x", "instructions": "be brief", "model": "m"}, None,
     {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}]}),
    ("/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "f"}]}, None,
     {"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f", "description": None, "parameters": None}}]}),
    ("/v1/responses", {"input": [{"type": "web_search_call"}]}, None, None),   # the node refuses it
    ("/v1/responses", {"input": "x", "previous_response_id": "resp_1"}, None, None),
    # an Anthropic Messages body: the chat body it asks for (the system prompt first, tools in chat's shape)
    ("/v1/messages", {"model": "m", "system": "be brief", "max_tokens": 5,
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}, None,
     {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}]}),
    ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                      "tools": [{"name": "f", "input_schema": {}}]}, None,
     {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [
         {"type": "function", "function": {"name": "f", "description": None, "parameters": {"type": "object"}}}]}),
    ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     None, None),   # the node refuses it
])
def test_how_a_prompt_is_found(path, body, ids, tokenize):
    assert token_ids_in_body(path, body) == ids
    if ids is None:
        assert tokenize_body(path, body) == tokenize


@pytest.mark.parametrize("keep, expected", [(2, [3, 4]), (9, [1, 2, 3, 4]), (-1, [1, 2, 3, 4]), (None, [1, 2, 3, 4]),
                                            (True, [1, 2, 3, 4]), ("2", [1, 2, 3, 4])])
def test_a_truncated_prompt_is_predicted_as_served(keep, expected):
    assert truncated({"truncate_prompt_tokens": keep}, [1, 2, 3, 4]) == expected


def test_cache_salt_is_utf8():
    assert cache_salt({"cache_salt": "é"}) == "é".encode() and cache_salt({}) is None


def test_a_calls_work_leaves_the_queue_when_the_node_has_done_it():
    """A call's prompt tokens are queued work until the node's first token; its decode is the per-call load."""
    node = _node(1)
    router = Router((node,), RoutingPolicy.CACHE_AWARE)
    with router.in_flight(node, work_tokens=100) as work_done:
        with router.in_flight(node, work_tokens=7):
            assert router.queued_tokens(node) == 107
            work_done()
            work_done()                       # once only
            assert router.queued_tokens(node) == 7 and router.outstanding(node) == 2
        assert router.queued_tokens(node) == 0 and router.outstanding(node) == 1
    assert router.queued_tokens(node) == 0 and router.outstanding(node) == 0


async def test_a_decode_streams_first_bytes_end_its_queued_work():
    class Content:
        async def iter_any(self):
            for chunk in (b"data: 1\n\n", b"data: 2\n\n"):
                assert calls == ([] if chunk == b"data: 1\n\n" else ["done"])
                yield chunk

    class Response:
        status, headers, content = 200, {"Content-Type": "text/event-stream"}, Content()

    calls: list[str] = []
    stream = DecodeStream(_node(1), Response(), InFlightCall(work_done=lambda: calls.append("done")))
    assert [c async for c in stream.chunks()] == [b"data: 1\n\n", b"data: 2\n\n"]
    assert calls == ["done"]


@pytest.mark.parametrize("prompt, expected", [
    ([1, 2, 3], [1, 2, 3]),
    ([[1, 2]], [1, 2]),
    ([1, 2 ** 63], None),        # past what a block hash encodes: no prediction (the node answers 400)
    ([1, -1], None),
    ([True, 2], None),
])
def test_token_ids_in_a_body_are_taken_only_within_range(prompt, expected):
    from hybridpd.proxy.cache_aware import token_ids_in_body

    assert token_ids_in_body("/v1/completions", {"prompt": prompt}) == expected


def _system_first_tokenizer(body):
    """A node whose chat template wants the system prompt first (Qwen's): a later system message is refused; else
    each message's text as its bytes."""
    messages = body["messages"]
    if any(m["role"] == "system" for m in messages[1:]):
        return 400, {"error": {"message": "chat template: System message must be at the beginning.",
                               "type": "invalid_request_error", "param": "messages", "code": 400}}
    return 200, {"tokens": [b for m in messages for b in str(m["content"]).encode()]}


@pytest.mark.parametrize("system", ["be brief", [{"type": "text", "text": "be brief"}]])
async def test_a_messages_prompt_is_tokenized_as_a_system_first_node_renders_it(make_harness, system):
    from .fake_node import Behavior

    h = await make_harness([Behavior.OK], [Behavior.OK])
    h.decode[0].tokenizer = _system_first_tokenizer
    inline = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"},
              {"role": "user", "content": [{"type": "text", "text": "again"}]}]
    body = {"model": "m", "max_tokens": 5, "system": system, "messages": inline}
    prompt = await h.proxy._prompt("/v1/messages", body)
    assert prompt is not None and bytes(prompt.token_ids) == b"be briefhiyesagain"
    assert len(h.decode[0].received) == 1

    # Claude Code's shape: a system reminder inside the conversation; refused as written, asked again joined
    reminder = [*inline[:2], {"role": "system", "content": "remember"}, inline[2]]
    body = {"model": "m", "max_tokens": 5, "system": system, "messages": reminder}
    prompt = await h.proxy._prompt("/v1/messages", body)
    assert prompt is not None and bytes(prompt.token_ids) == b"be briefrememberhiyesagain"   # as the node joins it
    assert [r.body["messages"][0]["role"] for r in h.decode[0].received[1:]] == ["system", "system"]
    assert len(h.decode[0].received) == 3
