"""vLLM's `--api-key`, for `serve` and `proxy`: with one or more keys (the flag repeated, or `VLLM_API_KEY` when no
flag gives one, as vLLM reads it), every route under `/v1` (the OpenAI and Anthropic APIs, as vLLM guards them)
asks for one of them, as `Authorization: Bearer KEY` (OpenAI's clients, and vLLM's only way) or `x-api-key: KEY`
(Anthropic's client); `/health`, `/metrics`, the tokenizer's endpoints and the KV routes stay open, as vLLM leaves
them. A proxy with keys checks its clients and presents its first key to the nodes (one key for the cluster's API).

Keys are secrets: compared as SHA-256 digests in constant time, never logged.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field

GUARDED_PREFIX = "/v1"
API_KEY_ENV = "VLLM_API_KEY"
ANTHROPIC_KEY_HEADER = "x-api-key"


REFUSAL = ("a valid API key is required: send it as `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: "
           "KEY` (Anthropic's)")


def add_api_key_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, help_text: str) -> None:
    parser.add_argument("--api-key", action="append", default=None, metavar="KEY",
                        help=f"{help_text} (repeat it for several keys; default: ${API_KEY_ENV} when set)")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


@dataclass(frozen=True)
class ApiKeys:
    """The keys a server asks for (none: every route is open)."""

    keys: tuple[str, ...] = field(default=(), repr=False)
    _digests: tuple[bytes, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if any(not key for key in self.keys):
            raise ValueError("--api-key must not be empty")
        object.__setattr__(self, "_digests", tuple(_digest(key) for key in self.keys))

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str]) -> ApiKeys:
        if args.api_key is not None:
            return cls(tuple(args.api_key))
        return cls((environ[API_KEY_ENV],) if environ.get(API_KEY_ENV) else ())

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def refuses(self, method: str, path: str, headers: Mapping[str, str]) -> bool:
        """Whether a request must be refused (401): a guarded route without one of the keys (a CORS preflight,
        `OPTIONS`, never is)."""
        guarded = path == GUARDED_PREFIX or path.startswith(GUARDED_PREFIX + "/")
        return self.required and guarded and method != "OPTIONS" and not self.allows(headers)

    def allows(self, headers: Mapping[str, str]) -> bool:
        """Whether the request's headers present one of the keys."""
        presented = []
        scheme, _, bearer = headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            presented.append(bearer)
        if ANTHROPIC_KEY_HEADER in headers:
            presented.append(headers[ANTHROPIC_KEY_HEADER])
        matched = False
        for candidate in presented:
            digest = _digest(candidate)
            for key_digest in self._digests:
                matched |= hmac.compare_digest(digest, key_digest)
        return matched

    def headers(self) -> dict[str, str]:
        """What a proxy presents to its nodes: its first key, or nothing."""
        return {"Authorization": f"Bearer {self.keys[0]}"} if self.keys else {}
