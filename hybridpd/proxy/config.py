"""The proxy's one frozen config: its listen address, its upstreams, the routing policy and timeouts."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path

from hybridpd.api_keys import ApiKeys
from hybridpd.cors import CorsPolicy
from hybridpd.proxy.outliers import OutlierPolicy
from hybridpd.tls import TLSConfig


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class RoutingPolicy(enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_OUTSTANDING = "least_outstanding"
    CACHE_AWARE = "cache_aware"   # proxy/cache_aware.py: predicted prefix hit traded against load


@dataclass(frozen=True, kw_only=True)
class CostRule:
    """`--routing cache_aware`'s weights (the rule: proxy/cache_aware.py): what one call in flight on a node costs,
    in prompt tokens, and how much the miss tokens queued on a node weigh against the request's own."""

    load_tokens_per_request: int = 32
    queued_tokens_weight: float = 0.5
    storage_hit_weight: float = 0.5   # a token the node reads from its storage tier, against one it computes
    # Disaggregate only a prompt of which the chosen decode node would compute at least this many tokens itself;
    # below, that node serves the request whole (no prefill call, no pull). 0: every request is disaggregated.
    pd_threshold: int = 0

    def __post_init__(self) -> None:
        if self.load_tokens_per_request < 0:
            raise ValueError(f"--load-tokens-per-request must be >= 0, got {self.load_tokens_per_request}")
        if not 0 <= self.queued_tokens_weight <= 1:
            raise ValueError(f"--queued-tokens-weight must be in [0, 1], got {self.queued_tokens_weight}")
        if not 0 <= self.storage_hit_weight <= 1:
            raise ValueError(f"--storage-hit-weight must be in [0, 1], got {self.storage_hit_weight}")
        if self.pd_threshold < 0:
            raise ValueError(f"--pd-threshold must be >= 0, got {self.pd_threshold}")

    def check_routing(self, routing: RoutingPolicy) -> None:
        """`--pd-threshold` reads the decode node's index, which only cache_aware routing keeps."""
        if self.pd_threshold and routing is not RoutingPolicy.CACHE_AWARE:
            raise ValueError("--pd-threshold needs --routing cache_aware (it reads the decode node's predicted hit)")


@dataclass(frozen=True, kw_only=True)
class Upstream:
    """One node the proxy talks to, in one role (the same node may appear in both roles)."""

    role: Role
    host: str
    port: int

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError(f"{self.role.value} host must not be empty")
        if not 0 < self.port < 65536:
            raise ValueError(f"{self.role.value} port out of range: {self.port}")
        # A routing decision looks every upstream up in a few dicts: hash the fields once, not at every lookup.
        object.__setattr__(self, "_hash", hash((self.role, self.host, self.port)))

    def __hash__(self) -> int:
        return self._hash

    def __getstate__(self) -> dict[str, object]:   # a string's hash is per process: never carry one across
        return {"role": self.role, "host": self.host, "port": self.port}

    def __setstate__(self, state: dict[str, object]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_hash", hash((self.role, self.host, self.port)))

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def name(self) -> str:
        """How logs, metrics and error messages name this upstream: `prefill node 127.0.0.1:8100`."""
        return f"{self.role.value} node {self.address}"


@dataclass(frozen=True, kw_only=True)
class DnsSource:
    """A role's nodes from DNS: every A (and AAAA) record of `name` is a node listening on `port`."""

    role: Role
    name: str
    port: int

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError(f"{self.role.value} DNS name must not be empty")
        if not 0 < self.port < 65536:
            raise ValueError(f"{self.role.value} DNS port out of range: {self.port}")

    @classmethod
    def parse(cls, role: Role, text: str) -> DnsSource:
        """`NAME:PORT` (as `--prefiller-dns prefill.hybridpd.svc.cluster.local:8100`)."""
        name, sep, port = text.rpartition(":")
        if not sep or not name or not port.isdigit():
            raise ValueError(f"a DNS source is NAME:PORT, got {text!r}")
        return cls(role=role, name=name, port=int(port))


@dataclass(frozen=True, kw_only=True)
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    prefillers: tuple[Upstream, ...]
    decoders: tuple[Upstream, ...]
    routing: RoutingPolicy = RoutingPolicy.ROUND_ROBIN
    prefill_timeout: float = 120.0   # seconds for the whole prefill call
    prefill_first_byte_timeout: float = 5.0   # seconds for a prefill node's first byte (its 100 Continue)
    decode_timeout: float = 120.0    # streamed decode calls: seconds without a byte (idle gap, not total)
    decode_request_timeout: float = 1800.0   # non-streamed decode calls: seconds for the whole generation
    decode_first_byte_timeout: float = 5.0   # seconds for a decode node's first byte (its 100 Continue)
    sse_keep_alive: float | None = None   # seconds a chat or completions stream may go quiet before a comment
    cors: CorsPolicy = CorsPolicy()       # vLLM's CORS flags (hybridpd/cors.py): every origin by default
    probe_interval: float = 1.0      # seconds between active probes of every node
    outliers: OutlierPolicy = field(default_factory=OutlierPolicy)
    connect_timeout: float = 5.0     # seconds to open a connection to any node
    health_timeout: float = 2.0      # seconds for one upstream's GET /health
    cluster_token: str | None = field(default=None, repr=False)
    api_keys: ApiKeys = ApiKeys()   # --api-key: asked of clients on `/v1` routes, the first one shown to nodes
    prefill_dns: DnsSource | None = None   # nodes from DNS, re-resolved every dns_interval (static ones are then ())
    decode_dns: DnsSource | None = None
    dns_interval: float = 5.0
    dns_server: tuple[str, int] | None = None  # None: the system's resolver
    nodes_file: Path | None = None             # both roles' nodes from a watched JSON file (proxy/nodes_file.py)
    # No prefill node can take a request (none known, or the prefill hop failed after its retry): send it to a
    # decode node without kv_transfer_params, which prefills it locally (latency, not an error).
    fallback_colocated: bool = True
    # A streaming client's first token from the prefill call's own stream, before the decode call opens
    # (proxy/prefill_stream.py); off: the decode node streams it (every node of the pool must know `stream_head`).
    first_token_from_prefill: bool = True
    # cache_aware: the weights of the cost rule (proxy/cache_aware.py)
    cost_rule: CostRule = field(default_factory=CostRule)
    tls: TLSConfig | None = None     # proxy -> node calls over HTTPS, with this certificate (hybridpd/tls.py)
    otlp_traces_endpoint: str | None = None   # OpenTelemetry traces (hybridpd/tracing.py); None: off

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def base_url(self, upstream: Upstream) -> str:
        """Where the proxy calls `upstream` (https when TLS is on)."""
        host = f"[{upstream.host}]" if ":" in upstream.host else upstream.host
        return f"{self.scheme}://{host}:{upstream.port}"

    def __post_init__(self) -> None:
        if not self.prefillers and self.prefill_dns is None and self.nodes_file is None:
            raise ValueError("at least one prefill node is required (or --prefiller-dns, or --nodes-file)")
        if not self.decoders and self.decode_dns is None and self.nodes_file is None:
            raise ValueError("at least one decode node is required (or --decoder-dns, or --nodes-file)")
        if self.dns_interval <= 0:
            raise ValueError(f"--dns-interval must be positive, got {self.dns_interval}")
        if any(u.role is not Role.PREFILL for u in self.prefillers):
            raise ValueError("prefillers must all have Role.PREFILL")
        if any(u.role is not Role.DECODE for u in self.decoders):
            raise ValueError("decoders must all have Role.DECODE")
        for name in ("prefill_timeout", "prefill_first_byte_timeout", "decode_timeout", "decode_request_timeout",
                     "decode_first_byte_timeout", "connect_timeout", "health_timeout", "probe_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        self.cost_rule.check_routing(self.routing)
        if self.cluster_token is not None and not self.cluster_token:
            raise ValueError("the cluster token must not be empty")

    @property
    def upstreams(self) -> tuple[Upstream, ...]:
        """The static nodes (a role discovered through DNS has none here: see the routers)."""
        return self.prefillers + self.decoders

    @property
    def dns_sources(self) -> tuple[DnsSource, ...]:
        return tuple(s for s in (self.prefill_dns, self.decode_dns) if s is not None)
