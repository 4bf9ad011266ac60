"""`--kv-events-config`: vLLM's JSON object, with vLLM's field names and defaults (vllm/config/kv_events.py)."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, fields


@dataclass(frozen=True, kw_only=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"               # "zmq" or "null"; vLLM's default: "zmq" when events are enabled
    endpoint: str = "tcp://*:5557"        # bind when it has a wildcard (`*`), else connect (as vLLM)
    replay_endpoint: str | None = None    # ROUTER socket that resends buffered batches from a sequence number
    buffer_steps: int = 10_000            # batches kept for replay
    hwm: int = 100_000                    # ZMQ high-water mark of the PUB socket (a slow subscriber drops past it)
    max_queue_size: int = 100_000         # batches waiting for the publisher thread (the engine never blocks)
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be \"zmq\" or \"null\", got {self.publisher!r}")
        for name in ("buffer_steps", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--kv-events-config: {name} must be >= 1, got {getattr(self, name)}")
        if self.hwm < 0:
            raise ValueError(f"--kv-events-config: hwm must be >= 0, got {self.hwm}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"--kv-events-config: {name} must be a ZMQ address (tcp://host:port), got {value!r}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, text: str | None) -> KVEventsConfig:
        """From the flag's JSON; raises ValueError naming the problem."""
        if text is None:
            return cls()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        types = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(raw) - set(types))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {unknown}; known: {sorted(types)}")
        for name, value in raw.items():
            if not _fits(types[name], value):
                raise ValueError(f"--kv-events-config: {name} must be {types[name]}, got {value!r}")
        if "publisher" not in raw:
            raw["publisher"] = "zmq" if raw.get("enable_kv_cache_events") else "null"
        return cls(**raw)


def _fits(annotation: str, value: object) -> bool:
    if annotation == "bool":
        return isinstance(value, bool)
    if annotation == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation == "str":
        return isinstance(value, str)
    return value is None or isinstance(value, str)  # "str | None"


def listen_endpoint(endpoint: str, host: str) -> str:
    """Where a node started with `--host host` binds a wildcard endpoint: on that host (a name resolved to its IPv4
    address), never on every interface unless `host` is itself a wildcard. A node told to listen on loopback keeps
    its KV events there too: they carry every block's token ids."""
    if not endpoint.startswith("tcp://*:") or host in ("0.0.0.0", "", "::", "*"):
        return endpoint
    try:
        address = socket.gethostbyname(host)
    except OSError as exc:
        raise ValueError(f"--host {host!r} does not resolve to an IPv4 address for the KV event sockets: {exc}") \
            from exc
    return endpoint.replace("*", address, 1)


def binds(endpoint: str) -> bool:
    """vLLM's rule: an address with a wildcard (or ipc/inproc) is bound, any other is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
