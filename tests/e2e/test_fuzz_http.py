"""Fuzzed HTTP input against real processes: a node, and a proxy in front of 1P+1D.

Hypothesis draws JSON bodies for /v1/completions, /v1/chat/completions, /v1/responses and /v1/messages: mostly-valid
bodies with one field replaced by anything, bodies of arbitrary optional fields, arbitrary JSON and raw bytes. Each
answer must be below 500 (and a 4xx must be OpenAI's error shape, or Anthropic's on /v1/messages); a streamed answer
must carry no 5xx error event (a Responses or Messages stream no error event at all: its body was checked before it
began). Afterwards
every process is alive and healthy, a fixed greedy request gives the same tokens as before the fuzzing, and no
block or lease is left. Generation stays short: the nodes run with `--max-model-len 128`, so an output never runs
past it (a body asking for more than 128 tokens is a 400, the rest are cut to what the prompt leaves), and
`--kv-load-timeout 5` bounds a pull aimed at a port nobody serves.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridpd.presets.checkpoints import write_checkpoint
from tests.e2e.nodes import NodeProcess, free_port
from tests.e2e.faults import (
    NodeSlot,
    ProxyProcess,
    assert_clean,
    start_all,
    start_proxy,
    stop_all,
)

EXAMPLES = 40   # per (target, route): 240 requests in all, each short
FUZZ_NODE_ARGS = ("--kv-cache-memory", "32MiB", "--max-model-len", "128", "--kv-load-timeout", "5",
                  "--kv-lease-seconds", "2", "--max-num-seqs", "8")
MODEL = "tiny"
GREEDY = {"prompt": "a fixed greedy probe", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
          "return_token_ids": True}


@dataclass(frozen=True)
class Target:
    name: str
    port: int
    side_channel_port: int   # a real side channel, so that some remote-prefill bodies reach a live peer


@dataclass
class Fleet:
    prefill: NodeProcess
    decode: NodeProcess
    proxy: ProxyProcess

    def targets(self) -> dict[str, Target]:
        return {"node": Target("node", self.decode.port, self.prefill.kv_port),
                "proxy": Target("proxy", self.proxy.port, self.prefill.kv_port)}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    model = write_checkpoint("tiny", tmp_path_factory.mktemp("model") / MODEL)  # served as "tiny"
    logs = tmp_path_factory.mktemp("logs")
    slots = [NodeSlot(model, logs, FUZZ_NODE_ARGS, "prefill"), NodeSlot(model, logs, FUZZ_NODE_ARGS, "decode")]
    proxy = None
    try:
        prefill, decode = start_all(slots)
        proxy = start_proxy(prefill, decode, logs)
        yield Fleet(prefill, decode, proxy)
    finally:
        if proxy is not None:
            proxy.stop()
        stop_all(slots)


# -- strategies ---------------------------------------------------------------------------------------------------
SCALAR = (st.none() | st.booleans() | st.integers(min_value=-(2**66), max_value=2**66)
          | st.sampled_from([0, 1, -1, 63, 64, 65, 257, 258, 2**31, 2**63]) | st.floats(allow_nan=False)
          | st.text(max_size=10) | st.sampled_from(["", MODEL, "\x00", "\u2028", "null"]))
ANY_JSON = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
KV_PARAMS = st.fixed_dictionaries({}, optional={
    "do_remote_decode": st.booleans() | ANY_JSON,
    "do_remote_prefill": st.booleans() | ANY_JSON,
    "remote_engine_id": st.sampled_from(["", "hybridpd-000000000000"]) | ANY_JSON,
    "remote_request_id": st.sampled_from(["cmpl-x", ""]) | ANY_JSON,
    "remote_block_ids": st.lists(st.lists(st.integers(min_value=-2, max_value=40), max_size=3), max_size=6)
    | ANY_JSON,
    "remote_host": st.sampled_from(["127.0.0.1", "localhost"]) | ANY_JSON.filter(lambda v: not isinstance(v, str)),
    "remote_port": st.sampled_from(["SIDE", "CLOSED", 0, 65536]) | ANY_JSON,
    "remote_num_tokens": st.integers(min_value=-1, max_value=70) | ANY_JSON,
    "remote_lease_expiry": st.floats() | ANY_JSON,
})
# Well-typed remote-prefill params (the shape a prefill node answers) with made-up values: they pass parsing and
# reach the engine's checks (a 400) or the pull, against a closed port or the live side channel with no such lease
# (a 502 naming the peer: see `_check_answer`).
REMOTE_PREFILL = st.fixed_dictionaries({
    "do_remote_prefill": st.just(True),
    "remote_engine_id": st.sampled_from(["hybridpd-000000000000", "x"]),
    "remote_request_id": st.sampled_from(["cmpl-x", "cmpl-y"]),
    "remote_block_ids": st.lists(st.lists(st.integers(min_value=0, max_value=40), max_size=3), max_size=6),
    "remote_host": st.just("127.0.0.1"),
    "remote_port": st.sampled_from(["SIDE", "CLOSED"]),
    "remote_num_tokens": st.integers(min_value=0, max_value=20),
})
USAGE_OPTIONS = st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                    "continuous_usage_stats": st.booleans()})
TOKEN_IDS = st.lists(st.integers(min_value=0, max_value=257), min_size=1, max_size=6)
SHORT_PROMPT = st.text(min_size=1, max_size=16) | TOKEN_IDS
VALID_FIELDS = {
    "model": st.just(MODEL), "max_tokens": st.integers(min_value=1, max_value=4),
    "temperature": st.floats(min_value=0, max_value=2), "top_p": st.floats(min_value=0.05, max_value=1),
    "top_k": st.integers(min_value=-1, max_value=300), "seed": st.integers(min_value=0, max_value=2**32),
    "stop": st.lists(st.text(min_size=1, max_size=2), max_size=2), "ignore_eos": st.booleans(),
    "stream": st.booleans(), "return_token_ids": st.booleans(),
}
FIELD_NAMES = sorted({*VALID_FIELDS, "prompt", "messages", "logprobs", "max_completion_tokens", "n", "echo",
                      "kv_transfer_params", "top_logprobs", "user", "presence_penalty", "stream_options",
                      "prompt_logprobs", "structured_outputs", "response_format", "tools", "tool_choice",
                      "parallel_tool_calls"})
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                           "content": st.text(max_size=12)}), min_size=1, max_size=3)
ODD_MESSAGES = st.lists(st.fixed_dictionaries({}, optional={"role": ANY_JSON, "content": ANY_JSON, "tool_calls": ANY_JSON,
                                                             "tool_call_id": ANY_JSON, "name": ANY_JSON}), max_size=3)


def _one_field_replaced(base: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    """`base` bodies, half of them with one field (known to the API or not) set to any JSON value."""
    value = ANY_JSON | KV_PARAMS
    return st.tuples(base, st.sampled_from(FIELD_NAMES), value, st.booleans()).map(
        lambda parts: {**parts[0], parts[1]: parts[2]} if parts[3] else parts[0])


def _bodies(required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy],
            free: dict[str, st.SearchStrategy]) -> st.SearchStrategy[dict]:
    """Near-valid bodies (most reach the engine), near-valid ones steering a KV transfer, and free-form ones."""
    base = st.fixed_dictionaries(required, optional=optional)
    steering = st.tuples(base, REMOTE_PREFILL | st.just({"do_remote_decode": True}) | KV_PARAMS).map(
        lambda parts: {**parts[0], "kv_transfer_params": parts[1]})
    return st.one_of(_one_field_replaced(base), steering, st.fixed_dictionaries({}, optional=free))


COMPLETION = _bodies({"prompt": SHORT_PROMPT}, VALID_FIELDS,
                     {"prompt": SHORT_PROMPT | ANY_JSON, "max_tokens": ANY_JSON, "stream": ANY_JSON,
                      "kv_transfer_params": KV_PARAMS | ANY_JSON})
# Well-typed tools (parameters a schema, or any JSON) and every kind of tool choice, named tools that exist or not.
TOOLS = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g"])},
    optional={"parameters": st.just({"type": "object", "properties": {"x": {"type": "integer"}}}) | ANY_JSON})}),
    min_size=1, max_size=2)
TOOL_CHOICE = st.sampled_from(["none", "auto", "required"]) | st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "h"])})})
CHAT = _bodies({"messages": MESSAGES}, {**VALID_FIELDS, "max_completion_tokens": st.integers(1, 3),
                                        "tools": TOOLS, "tool_choice": TOOL_CHOICE, "echo": st.booleans(),
                                        "add_generation_prompt": st.booleans(),
                                        "continue_final_message": st.booleans(), "stream_options": USAGE_OPTIONS},
               {"messages": MESSAGES | ODD_MESSAGES | ANY_JSON, "max_tokens": ANY_JSON,
                "kv_transfer_params": KV_PARAMS | ANY_JSON})
ITEMS = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant"]),
                                        "content": st.text(max_size=12)},
                                       optional={"type": st.just("message"),
                                                 "status": st.sampled_from(["completed", "incomplete"])}),
                 min_size=1, max_size=3)
FLAT_TOOLS = st.lists(st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(["f", "g"])},
                                            optional={"parameters": st.just({"type": "object"}) | ANY_JSON}),
                      min_size=1, max_size=2)
RESPONSES = _bodies({"input": st.text(min_size=1, max_size=16) | ITEMS},
                    {**{k: v for k, v in VALID_FIELDS.items() if k not in ("max_tokens", "return_token_ids")},
                     "max_output_tokens": st.integers(1, 3), "instructions": st.text(max_size=8), "tools": FLAT_TOOLS,
                     "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "name": "f"}])},
                    {"input": ITEMS | ANY_JSON, "max_output_tokens": ANY_JSON, "text": ANY_JSON,
                     "kv_transfer_params": KV_PARAMS | ANY_JSON})
BLOCKS = st.lists(st.sampled_from([
    {"type": "text", "text": "hi"}, {"type": "text", "text": ""}, {"type": "thinking", "thinking": "t"},
    {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}},
    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "1"}]},
    {"type": "image", "source": {}}]) | ANY_JSON, min_size=1, max_size=3)
ANTHROPIC_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                                     "content": st.text(max_size=12) | BLOCKS}), min_size=1, max_size=3)
ANTHROPIC_TOOLS = st.lists(st.fixed_dictionaries({"name": st.sampled_from(["f", "g"])}, optional={
    "input_schema": st.just({"type": "object", "properties": {"x": {"type": "integer"}}}) | ANY_JSON}),
    min_size=1, max_size=2)
MESSAGES_API = _bodies({"model": st.just(MODEL), "max_tokens": st.integers(1, 3), "messages": ANTHROPIC_MESSAGES},
                       {**{k: v for k, v in VALID_FIELDS.items()
                           if k in ("temperature", "top_p", "top_k", "stream")},
                        "system": st.text(max_size=8), "stop_sequences": st.lists(st.text(min_size=1, max_size=2)),
                        "tools": ANTHROPIC_TOOLS, "tool_choice": st.sampled_from(
                            [{"type": "auto"}, {"type": "any"}, {"type": "none"}, {"type": "tool", "name": "f"},
                             {"type": "tool", "name": "h"}])},
                       {"messages": ANTHROPIC_MESSAGES | ANY_JSON, "max_tokens": ANY_JSON, "system": ANY_JSON,
                        "kv_transfer_params": KV_PARAMS | ANY_JSON})
RAW = ANY_JSON.map(lambda value: json.dumps(value).encode()) | st.binary(max_size=30)


def _ports_filled(value: Any, target: Target, closed_port: int) -> Any:
    """Put real port numbers where the strategy left the placeholders "SIDE" and "CLOSED"."""
    if isinstance(value, dict):
        return {k: _ports_filled(v, target, closed_port) for k, v in value.items()}
    if isinstance(value, list):
        return [_ports_filled(v, target, closed_port) for v in value]
    return {"SIDE": target.side_channel_port, "CLOSED": closed_port}.get(value, value) \
        if isinstance(value, str) else value


# -- the check ----------------------------------------------------------------------------------------------------
def _post_raw(port: int, path: str, data: bytes) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type", ""), response.read()
    finally:
        conn.close()


def _steers_a_pull(sent: bytes) -> bool:
    try:
        body = json.loads(sent)
    except ValueError:
        return False
    params = body.get("kv_transfer_params") if isinstance(body, dict) else None
    return isinstance(params, dict) and params.get("do_remote_prefill") is True


def _check_answer(status: int, content_type: str, raw: bytes, sent: bytes) -> None:
    """Below 500, except one case: well-formed remote-prefill params that name no live lease make the pull fail,
    which is a failed request with a message (a 502 naming the peer), not a server error."""
    if status == 502 and _steers_a_pull(sent):
        error = json.loads(raw)["error"]
        assert error["type"] in ("kv_transfer_error", "api_error") and "127.0.0.1:" in error["message"], raw[:300]
        return
    assert status < 500, (status, sent[:300], raw[:300])
    if status >= 400:
        error = json.loads(raw)["error"]
        assert isinstance(error["message"], str) and error["message"], raw[:300]
    elif content_type.startswith("text/event-stream"):
        for line in raw.decode().splitlines():
            if line.startswith("data: {"):
                event = json.loads(line[len("data: "):])
                code = event.get("error", {}).get("code", 0) if isinstance(event.get("error"), dict) else 0
                assert not (isinstance(code, int) and code >= 500), (sent[:300], line[:300])
                # a Responses or Messages stream's error event: its body was checked before the stream began, so any
                # is a fault
                assert event.get("type") != "error", (sent[:300], line[:300])


def _fuzz(target: Target, path: str, bodies: st.SearchStrategy[dict]) -> None:
    closed = free_port()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture])
    @given(data=bodies.map(lambda body: json.dumps(_ports_filled(body, target, closed)).encode()) | RAW)
    def check(data: bytes) -> None:
        _check_answer(*_post_raw(target.port, path, data), sent=data)

    check()


def _greedy_ids(port: int) -> list[int]:
    status, _, raw = _post_raw(port, "/v1/completions", json.dumps(GREEDY).encode())
    assert status == 200, raw[:300]
    return json.loads(raw)["choices"][0]["token_ids"]


@pytest.mark.parametrize("target_name", ["node", "proxy"])
@pytest.mark.parametrize("path, bodies", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                                          ("/v1/responses", RESPONSES), ("/v1/messages", MESSAGES_API)],
                         ids=["completions", "chat", "responses", "messages"])
def test_fuzzed_bodies_never_5xx_and_leave_the_cluster_healthy_and_correct(fleet, target_name, path, bodies):
    target = fleet.targets()[target_name]
    before = _greedy_ids(target.port)
    _fuzz(target, path, bodies)
    for process in (fleet.prefill.proc, fleet.decode.proc, fleet.proxy.proc):
        assert process.poll() is None, "a process died under fuzzing"
    for port in (fleet.prefill.port, fleet.decode.port, fleet.proxy.port):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
    assert _greedy_ids(target.port) == before
    assert_clean(fleet.prefill, fleet.decode)


def _remote_params(fleet: Fleet, **fields: Any) -> dict[str, Any]:
    """Well-formed remote-prefill params for a 4-token prompt on the tiny model (each group needs one block)."""
    return {"do_remote_prefill": True, "remote_engine_id": "hybridpd-000000000000", "remote_request_id": "cmpl-x",
            "remote_block_ids": [[0]], "remote_host": "127.0.0.1", "remote_port": fleet.prefill.kv_port,
            "remote_num_tokens": 4, "first_token_id": 5, **fields}


@pytest.mark.parametrize("fields, names", [
    ({"remote_lease_expiry": 10 ** 400}, "remote_lease_expiry"),
    ({"first_token_logprob": {"token_id": 5, "logprob": -0.1, "top": [[10 ** 6, -0.2]]}}, "first_token_logprob.top"),
    ({"first_token_logprob": {"token_id": 5, "logprob": -0.1, "top": [[-1, -0.2]]}}, "first_token_logprob.top"),
    ({"first_token_logprob": {"token_id": 5, "logprob": 10 ** 400}}, "first_token_logprob.logprob"),
], ids=["huge-expiry", "top-id-above-vocab", "top-id-negative", "huge-logprob"])
def test_bad_transfer_params_that_once_reached_a_500_are_a_400(fleet, fields, names):
    """At a decode node (the proxy sends its own params to nodes, never the client's)."""
    target = fleet.targets()["node"]
    body = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 2, "kv_transfer_params": _remote_params(fleet, **fields)}
    status, _, raw = _post_raw(target.port, "/v1/completions", json.dumps(body).encode())
    assert status == 400, raw[:300]
    assert names.split(".")[0] in json.loads(raw)["error"]["message"], raw[:300]
    assert_clean(fleet.prefill, fleet.decode)
