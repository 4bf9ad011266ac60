"""The HTTP server's own frozen config (the engine and the connector have theirs in hybridpd/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridpd.api_keys import ApiKeys
from hybridpd.connector.trusted_peers import LOOPBACK_ONLY, TrustedPeers
from hybridpd.cors import CorsPolicy
from hybridpd.server.chat_templating import ChatTemplating
from hybridpd.server.request_log import RequestLogging
from hybridpd.server.tool_fields import ToolParsing
from hybridpd.server.watchdog import WatchdogBounds
from hybridpd.tls import TLSConfig

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8100
    served_model_name: str           # the name answers and metrics carry
    model_aliases: tuple[str, ...] = ()   # more names a request may give the model (listed in /v1/models too)
    shutdown_grace: float = 10.0
    health_port: int | None = None   # a plain-HTTP listener for /health alone (probes under mutual TLS)
    otlp_traces_endpoint: str | None = None   # OpenTelemetry traces (hybridpd/tracing.py); None: off
    watchdog: WatchdogBounds = field(default_factory=WatchdogBounds)   # the engine process's liveness bounds
    # When set, a request that carries `kv_transfer_params` must send it in CLUSTER_TOKEN_HEADER.
    cluster_token: str | None = field(default=None, repr=False)
    client_max_size: int = 64 * 1024 * 1024  # largest request body in bytes
    # The prefill nodes a remotely prefilled request may name in kv_transfer_params.remote_host.
    trusted_peers: TrustedPeers = field(default_factory=lambda: TrustedPeers.parse(LOOPBACK_ONLY))
    tls: TLSConfig | None = None    # HTTPS, mutual with a CA (hybridpd/tls.py)
    tokenizer_info_endpoint: bool = False   # GET /tokenizer_info (vLLM's --enable-tokenizer-info-endpoint)
    tool_parsing: ToolParsing = ToolParsing()   # --enable-auto-tool-choice, --tool-call-parser
    api_keys: ApiKeys = ApiKeys()   # --api-key: the `/v1` routes ask for one (hybridpd/api_keys.py)
    chat_template: str | None = None   # --chat-template's source: replaces the checkpoint's (chat_templating.py)
    templating: ChatTemplating = ChatTemplating()   # request templates trusted or not, default template variables
    sse_keep_alive: float | None = None   # seconds a chat or completions stream may go quiet before a comment
    force_include_usage: bool = False   # every chat and completions stream carries usage (vLLM's flag)
    tokens_as_ids: bool = False   # return_tokens_as_token_ids by default (vLLM's --return-tokens-as-token-ids)
    load_tracking: bool = False   # GET /load counts the generation requests in flight (else 0), as vLLM's flag
    request_id_headers: bool = False   # every answer carries X-Request-Id, as vLLM's flag
    cors: CorsPolicy = CorsPolicy()    # vLLM's CORS flags (hybridpd/cors.py): every origin by default
    request_logging: RequestLogging = RequestLogging()   # vLLM's request log (server/request_log.py): off
    access_log: bool = True            # a line per request, as uvicorn's (hybridpd/access_log.py)
    access_log_excluded: frozenset[str] = frozenset()   # paths left out of it

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may give the model: the served name first."""
        return (self.served_model_name, *self.model_aliases)

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.health_port is not None and not 0 < self.health_port < 65536:
            raise ValueError(f"--health-port must be in [1, 65535], got {self.health_port}")
        if not self.served_model_name or not all(self.model_aliases):
            raise ValueError("--served-model-name must not be empty")
        if self.shutdown_grace < 0:
            raise ValueError(f"--shutdown-grace must be >= 0, got {self.shutdown_grace}")
        if self.cluster_token is not None and not self.cluster_token:
            raise ValueError("the cluster token must not be empty")
        if self.client_max_size < 1024:
            raise ValueError(f"client_max_size must be >= 1024 bytes, got {self.client_max_size}")
