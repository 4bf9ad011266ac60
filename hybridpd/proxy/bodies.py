"""The two bodies the proxy derives from a client's body: one for the prefill node, one for the decode node.

Both are new dicts: the client's body is never edited in place. The shapes are vLLM's toy proxy's.
"""

from __future__ import annotations

from typing import Any

from hybridpd.completion_prompts import several_prompts
from hybridpd.message_bodies import MESSAGES_PATH
from hybridpd.response_bodies import RESPONSES_PATH
from hybridpd.samples import MAX_N, sample_seed
from hybridpd.stream_head import STREAM_HEAD_FIELD, StreamHead

# What the prefill call carries: "prefill here, hold the blocks, tell me where they are".
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Fields that make no sense for a one-token prefill call (vLLM's toy proxy drops them too).
_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_body(body: dict[str, Any], first_token_from_prefill: bool = True,
                 path: str = "/v1/chat/completions") -> dict[str, Any]:
    """The client's body for one token, asking for remote decode; streamed when the client streams and the head of
    its stream comes from this call (proxy/prefill_stream.py), else one JSON answer. A Responses body says its
    length as `max_output_tokens`, and its stream never begins with the prefill node's (its events are not chat
    chunks); nor does an Anthropic Messages body's."""
    out = {key: value for key, value in body.items() if key not in _PREFILL_DROPPED}
    if path == RESPONSES_PATH:
        out["max_output_tokens"] = 1
        out["stream"] = False
    elif path == MESSAGES_PATH:
        out["max_tokens"] = 1
        out["stream"] = False
    else:
        out["max_tokens"] = 1
        if "max_completion_tokens" in body:
            out["max_completion_tokens"] = 1
        out["stream"] = first_token_from_prefill and streams_head(body)
        options = body.get("stream_options")
        if out["stream"] and isinstance(options, dict) and options.get("continuous_usage_stats") is True \
                and options.get("include_usage") is True:   # the head's chunks carry the usage so far too
            out["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None,
                stream_head: StreamHead | None = None) -> dict[str, Any]:
    """The client's body plus the prefill node's answer (without one, the decode node computes the prompt) and,
    when the client has the stream's head already, which stream the decode node continues."""
    out = {key: value for key, value in body.items() if key != "kv_transfer_params"}
    if kv_transfer_params:
        head = {STREAM_HEAD_FIELD: stream_head.to_json()} if stream_head is not None else {}
        out["kv_transfer_params"] = {**kv_transfer_params, **head}
    return out


def served_whole(body: dict[str, Any]) -> bool:
    """Whether one node serves the whole request, unsplit: when its answer holds the prompt's own logprobs
    (`prompt_logprobs`, or `echo` with `logprobs`), which come from computing the prompt (a pull of its KV does not
    give them), or when it holds several prompts (each its own request on the node; one prefill answer carries one
    set of kv_transfer_params)."""
    if body.get("prompt_logprobs") is not None or (body.get("echo") is True and body.get("logprobs") is not None):
        return True
    return several_prompts(body.get("prompt")) is not None


def sample_bodies(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The body as one request per sample: `n` > 1 (an integer within the bound) as n bodies of `n` 1, sample i
    seeded with the body's seed + i (as the node seeds its own samples); any other body alone, as it is (a bad `n` or
    seed is the node's to refuse)."""
    n, seed = body.get("n"), body.get("seed")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 < n <= MAX_N:
        return [body]
    seeded = isinstance(seed, int) and not isinstance(seed, bool) and -(2**63) <= seed < 2**63
    return [{**body, "n": 1, **({"seed": sample_seed(seed, i)} if seeded else {})} for i in range(n)]


def wants_stream(body: dict[str, Any]) -> bool:
    return body.get("stream") is True


def streams_head(body: dict[str, Any]) -> bool:
    """Whether the client's stream begins with the prefill node's (proxy/prefill_stream.py): when it streams, unless
    it asks for one token only (that token's chunk is also the last, which only the decode node can tell) or may call
    tools (the decode node reads the calls from the whole text, the first token's included)."""
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    calls_tools = bool(body.get("tools")) and body.get("tool_choice") != "none"
    return wants_stream(body) and not (isinstance(limit, int) and limit == 1) and not calls_tools
