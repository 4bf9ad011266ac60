"""Where admitted prompts' tokens come from: the local prefix cache, a prefill node (pulled over NIXL), the storage
tier, or computed here, counted as vLLM's scheduler counts them for its metrics.

vLLM 0.32 (vllm/v1/metrics) counts, per request when it is first scheduled (a preempted request again is not): the
prompt tokens looked up in the prefix cache and those it held (`vllm:prefix_cache_queries` / `_hits`: the local
cache alone, none with prefix caching off); where a KV connector is configured, the tokens left after that hit
(`vllm:external_prefix_cache_queries`) and those the connector supplies (`_hits`); the cached tokens by the tier that
supplied them (`vllm:prompt_tokens_cached_by_source`, which sums to the local and external hits: `device` for the
local cache, `p2p` for another instance, `disk`, `host`, `external_unspecified`); and every prompt token by source
(`vllm:prompt_tokens_by_source`: `local_compute`, `local_cache_hit`, `external_kv_transfer`). Here the local cache is
the node's memory (`device`: this engine's own, CPU or not), a remote prefill's pull is `p2p` and the storage tier
(`--kv-offload-dir`) is `disk`. The connector is "configured" where a request can get tokens from outside: a node
that can pull (every node here: each is kv_both) or has a storage tier.

Counted at admission, as vLLM counts them: a storage read that then fails is recomputed (or pulled) without the
counts changing, as vLLM's do not on a failed load.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class CacheHitSource(str, Enum):
    """vLLM's `CacheHitSource` labels, in its order (nearest the compute first)."""

    DEVICE = "device"
    HOST = "host"
    P2P = "p2p"
    DISK = "disk"
    EXTERNAL_UNSPECIFIED = "external_unspecified"


class PromptTokenSource(str, Enum):
    """vLLM's `PromptTokenStats.ALL_SOURCES`."""

    LOCAL_COMPUTE = "local_compute"
    LOCAL_CACHE_HIT = "local_cache_hit"
    EXTERNAL_KV_TRANSFER = "external_kv_transfer"


@dataclass(frozen=True)
class PromptSources:
    """Totals since start-up, in tokens."""

    prompt_tokens: int = 0      # of the admitted requests
    queries: int = 0            # of them looked up in the local prefix cache (none with prefix caching off)
    local_hits: int = 0         # of them held by the local prefix cache
    external_queries: int = 0   # left after the local hit, where tokens can come from outside
    pulled: int = 0             # brought from a prefill node
    stored: int = 0             # read from the storage tier

    @property
    def external_hits(self) -> int:
        return self.pulled + self.stored

    @property
    def cached(self) -> int:
        return self.local_hits + self.external_hits

    def cached_by_source(self) -> dict[CacheHitSource, int]:
        """Every label vLLM exports (those this node never sees at 0)."""
        counts = dict.fromkeys(CacheHitSource, 0)
        counts[CacheHitSource.DEVICE] = self.local_hits
        counts[CacheHitSource.P2P] = self.pulled
        counts[CacheHitSource.DISK] = self.stored
        return counts

    def by_source(self) -> dict[PromptTokenSource, int]:
        return {PromptTokenSource.LOCAL_COMPUTE: self.prompt_tokens - self.cached,
                PromptTokenSource.LOCAL_CACHE_HIT: self.local_hits,
                PromptTokenSource.EXTERNAL_KV_TRANSFER: self.external_hits}

    def admitted(self, prompt_tokens: int, local_hit: int, *, external: bool, pulled: int = 0, stored: int = 0,
                 looked_up: bool = True) -> PromptSources:
        """These totals with one more request admitted: `prompt_tokens` of which the local cache held `local_hit`,
        `pulled` and `stored` came from outside; `external`: whether anything could have (a connector or a
        tier); `looked_up`: whether the local cache was (prefix caching on)."""
        if min(local_hit, pulled, stored) < 0 or local_hit + pulled + stored > prompt_tokens:
            raise ValueError(f"a prompt of {prompt_tokens} tokens cannot take {local_hit} from the local cache, "
                             f"{pulled} pulled and {stored} from storage")
        return PromptSources(
            prompt_tokens=self.prompt_tokens + prompt_tokens,
            queries=self.queries + (prompt_tokens if looked_up else 0), local_hits=self.local_hits + local_hit,
            external_queries=self.external_queries + (prompt_tokens - local_hit if external else 0),
            pulled=self.pulled + pulled, stored=self.stored + stored)
