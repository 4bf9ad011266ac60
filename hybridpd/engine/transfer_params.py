"""`kv_transfer_params`, vLLM's wire shape, parsed into typed values: the engine's own request types (the connector,
the server and the node roles import them from here; the engine imports no network package).

Request side (proxy -> prefill node): `do_remote_decode: true` asks this node to prefill for a remote decoder: it
computes the whole prompt, samples the first output token (its answer carries it, as vLLM's prefill answers do) and
holds the prompt's blocks.
Request side (proxy -> decode node): `do_remote_prefill: true` plus the fields that the prefill node answered with
(`remote_*` where the blocks are, `first_token_*` the token it sampled), asks this node to pull the prompt's KV from
that node and decode on from the first token, which it streams before the pull even starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hybridpd.engine.request import TokenLogprob
from hybridpd.errors import InvalidRequestError

_MAX_BLOCK_ID = 2**31 - 1


@dataclass(frozen=True, kw_only=True)
class RemoteDecodeParams:
    """Prefill here, hold the blocks under a lease, answer with `RemotePrefillParams` for the decoder."""


@dataclass(frozen=True, kw_only=True)
class RemotePrefillParams:
    """Where the prompt's KV lives (the prefill node's engine, request, blocks per group, side channel) and the
    first output token it sampled from the prompt's last logits (with its logprobs when the request asked)."""

    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: tuple[tuple[int, ...], ...]
    remote_host: str
    remote_port: int
    remote_num_tokens: int
    # Tokens of the prompt the prefill node found cached (memory or storage) rather than computed: what existed
    # before this request. A decode node reads at most these from its storage tier; the rest it pulls. None: unknown.
    remote_cached_tokens: int | None = None
    remote_lease_expiry: float | None = None
    remote_lease_secret: str | None = field(default=None, repr=False)  # proves this request holds the lease
    first_token_id: int
    first_token_logprob: TokenLogprob | None = None

    @property
    def peer(self) -> str:
        return f"{self.remote_host}:{self.remote_port}"

    def to_json(self) -> dict[str, Any]:
        return {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": self.remote_engine_id,
            "remote_request_id": self.remote_request_id,
            "remote_block_ids": [list(ids) for ids in self.remote_block_ids],
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
            "remote_num_tokens": self.remote_num_tokens,
            "remote_cached_tokens": self.remote_cached_tokens,
            "remote_lease_expiry": self.remote_lease_expiry,
            "remote_lease_secret": self.remote_lease_secret,
            "first_token_id": self.first_token_id,
            "first_token_logprob": _logprob_json(self.first_token_logprob),
        }


def _logprob_json(logprob: TokenLogprob | None) -> dict[str, Any] | None:
    if logprob is None:
        return None
    return {"token_id": logprob.token_id, "logprob": logprob.logprob, "top": [list(pair) for pair in logprob.top]}


KVTransferParams = RemoteDecodeParams | RemotePrefillParams


def _field(obj: dict[str, Any], name: str, kind: type, *, optional: bool = False) -> Any:
    value = obj.get(name)
    if value is None and optional:
        return None
    if value is None:
        raise InvalidRequestError(f"kv_transfer_params.{name} is required", f"kv_transfer_params.{name}")
    if kind is int and not _is_int(value):
        raise InvalidRequestError(f"kv_transfer_params.{name} must be an integer", f"kv_transfer_params.{name}")
    if kind is float and not _is_number(value):
        raise InvalidRequestError(f"kv_transfer_params.{name} must be a finite number", f"kv_transfer_params.{name}")
    if kind is str and (not isinstance(value, str) or not value):
        raise InvalidRequestError(f"kv_transfer_params.{name} must be a non-empty string", f"kv_transfer_params.{name}")
    if kind is bool and not isinstance(value, bool):
        raise InvalidRequestError(f"kv_transfer_params.{name} must be a boolean", f"kv_transfer_params.{name}")
    return value


def _block_ids(value: Any) -> tuple[tuple[int, ...], ...]:
    name = "kv_transfer_params.remote_block_ids"
    if not isinstance(value, list) or not all(isinstance(group, list) for group in value):
        raise InvalidRequestError(f"{name} must be a list of lists of block ids (one list per KV group)", name)
    for group in value:
        for block_id in group:
            if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id <= _MAX_BLOCK_ID:
                raise InvalidRequestError(f"{name} holds an invalid block id: {block_id!r}", name)
    return tuple(tuple(group) for group in value)


def _logprob(value: Any, first_token_id: int) -> TokenLogprob | None:
    name = "kv_transfer_params.first_token_logprob"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{name} must be an object or null", name)
    token_id, logprob = value.get("token_id"), value.get("logprob")
    if token_id != first_token_id or not _is_int(token_id):
        raise InvalidRequestError(f"{name}.token_id is {token_id!r}, first_token_id is {first_token_id}", name)
    if not _is_number(logprob):
        raise InvalidRequestError(f"{name}.logprob must be a finite number", name)
    top = value.get("top", [])
    if not isinstance(top, list) or not all(
        isinstance(pair, list) and len(pair) == 2 and _is_int(pair[0]) and _is_number(pair[1]) for pair in top
    ):
        raise InvalidRequestError(f"{name}.top must be a list of [token_id, logprob] pairs", name)
    return TokenLogprob(token_id=token_id, logprob=float(logprob),
                        top=tuple((int(t), float(lp)) for t, lp in top))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite number a float holds (an integer of 400 digits is not one: float() of it overflows)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def parse_kv_transfer_params(raw: Any) -> KVTransferParams | None:
    """None when the request is colocated; raises InvalidRequestError for a malformed value."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidRequestError("kv_transfer_params must be an object", "kv_transfer_params")
    remote_decode = bool(_field(raw, "do_remote_decode", bool, optional=True))
    remote_prefill = bool(_field(raw, "do_remote_prefill", bool, optional=True))
    if remote_decode and remote_prefill:
        raise InvalidRequestError(
            "kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true", "kv_transfer_params"
        )
    if remote_decode:
        return RemoteDecodeParams()
    if not remote_prefill:
        return None
    port = _field(raw, "remote_port", int)
    if not 0 < port < 65536:
        raise InvalidRequestError(f"kv_transfer_params.remote_port is out of range: {port}",
                                  "kv_transfer_params.remote_port")
    num_tokens = _field(raw, "remote_num_tokens", int)
    if num_tokens < 1:
        raise InvalidRequestError("kv_transfer_params.remote_num_tokens must be >= 1",
                                  "kv_transfer_params.remote_num_tokens")
    first_token_id = _field(raw, "first_token_id", int)
    if first_token_id < 0:
        raise InvalidRequestError("kv_transfer_params.first_token_id must be >= 0", "kv_transfer_params.first_token_id")
    cached = _field(raw, "remote_cached_tokens", int, optional=True)
    if cached is not None and not 0 <= cached <= num_tokens:
        raise InvalidRequestError("kv_transfer_params.remote_cached_tokens must be in [0, remote_num_tokens]",
                                  "kv_transfer_params.remote_cached_tokens")
    return RemotePrefillParams(
        remote_engine_id=_field(raw, "remote_engine_id", str),
        remote_request_id=_field(raw, "remote_request_id", str),
        remote_block_ids=_block_ids(_field(raw, "remote_block_ids", list)),
        remote_host=_field(raw, "remote_host", str),
        remote_port=port,
        remote_num_tokens=num_tokens,
        remote_cached_tokens=cached,
        remote_lease_expiry=_field(raw, "remote_lease_expiry", float, optional=True),
        remote_lease_secret=_field(raw, "remote_lease_secret", str, optional=True),
        first_token_id=first_token_id,
        first_token_logprob=_logprob(raw.get("first_token_logprob"), first_token_id),
    )
