"""The two bodies the proxy derives from a client's body: one for the prefill node, one for the decode node.

Both are new dicts: the client's body is never edited in place. The shapes are vLLM's toy proxy's.
"""

from __future__ import annotations

from typing import Any

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


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's body for one token, not streamed, asking for remote decode."""
    out = {key: value for key, value in body.items() if key not in _PREFILL_DROPPED}
    out["max_tokens"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The client's body plus the prefill node's answer; without one, the decode node computes the prompt."""
    out = {key: value for key, value in body.items() if key != "kv_transfer_params"}
    if kv_transfer_params:
        out["kv_transfer_params"] = kv_transfer_params
    return out


def wants_stream(body: dict[str, Any]) -> bool:
    return body.get("stream") is True
