"""What a local cluster is made of (`ClusterSpec`) and where its parts answer once up (`ClusterInfo`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from hybridpd.proxy.config import Role

KV_PORT_OFFSET = 1000  # node i: HTTP on base_port + i, gRPC side channel on base_port + 1000 + i
EVENTS_PORT_OFFSET = 2000  # with kv_events: KV event PUB on base_port + 2000 + i, its replay on base_port + 3000 + i
REPLAY_PORT_OFFSET = 3000


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    num_prefill: int = 1
    num_decode: int = 1
    model_dir: Path | None = None          # None: the built-in default model
    host: str = "127.0.0.1"
    port: int = 8000                       # the proxy
    base_port: int = 8100                  # the nodes, see KV_PORT_OFFSET
    threads: int = 1
    serve_args: tuple[str, ...] = ()       # extra `hybridpd serve` flags for every node
    proxy_args: tuple[str, ...] = ()       # extra `hybridpd proxy` flags
    run_dir: Path | None = None            # logs go here; None: a fresh temporary directory
    startup_timeout: float = 300.0         # seconds until every child must be healthy
    stop_grace: float = 10.0               # seconds between SIGTERM and SIGKILL
    python: str = sys.executable
    kv_events: bool = False                # nodes publish KV events (vLLM's format), for --routing cache_aware

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(f"--prefill and --decode must be >= 1, got {self.num_prefill} and {self.num_decode}")
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        top = REPLAY_PORT_OFFSET if self.kv_events else KV_PORT_OFFSET
        last_port = self.base_port + top + self.num_prefill + self.num_decode - 1
        if self.base_port < 1 or last_port > 65535:
            raise ValueError(f"--base-port {self.base_port} leaves no room for the nodes' ports (up to {last_port})")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port out of range: {self.port}")
        node_ports = set(range(self.base_port, self.base_port + self.num_prefill + self.num_decode))
        offsets = (KV_PORT_OFFSET, EVENTS_PORT_OFFSET, REPLAY_PORT_OFFSET) if self.kv_events else (KV_PORT_OFFSET,)
        kv_ports = {p + offset for p in node_ports for offset in offsets}
        if self.port in node_ports | kv_ports:
            raise ValueError(f"--port {self.port} collides with a node port derived from --base-port {self.base_port}")
        if self.startup_timeout <= 0 or self.stop_grace <= 0:
            raise ValueError("startup timeout and stop grace must be positive")

    def nodes(self) -> tuple[tuple[str, Role, int, int], ...]:
        """(name, role, HTTP port, side-channel port) of every node, prefill nodes first."""
        roles = [Role.PREFILL] * self.num_prefill + [Role.DECODE] * self.num_decode
        counters = {Role.PREFILL: 0, Role.DECODE: 0}
        out = []
        for index, role in enumerate(roles):
            out.append((f"{role.value}-{counters[role]}", role, self.base_port + index,
                        self.base_port + KV_PORT_OFFSET + index))
            counters[role] += 1
        return tuple(out)


@dataclass(frozen=True, kw_only=True)
class NodeInfo:
    name: str          # prefill-0, decode-0, ...
    role: Role
    url: str           # http://host:port
    port: int
    kv_port: int
    pid: int
    log_path: Path

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"


@dataclass(frozen=True, kw_only=True)
class ClusterInfo:
    proxy_url: str
    proxy_pid: int
    proxy_log_path: Path
    prefill: tuple[NodeInfo, ...]
    decode: tuple[NodeInfo, ...]
    run_dir: Path

    @property
    def nodes(self) -> tuple[NodeInfo, ...]:
        return self.prefill + self.decode

    @property
    def pids(self) -> tuple[int, ...]:
        return (self.proxy_pid,) + tuple(node.pid for node in self.nodes)

    def describe(self) -> str:
        lines = [
            f"hybridpd cluster is up (logs in {self.run_dir})",
            f"  proxy      {self.proxy_url}  (POST /v1/completions, /v1/chat/completions; GET /v1/models, "
            f"/health, /metrics)",
        ]
        for node in self.nodes:
            lines.append(
                f"  {node.name:<10} {node.url}  side channel :{node.kv_port}  metrics {node.metrics_url}"
            )
        lines.append(f"  bench with: hybridpd bench --base-url {self.proxy_url} --metrics-url "
                     + " ".join(node.metrics_url for node in self.decode))
        return "\n".join(lines)
