"""The wire between a node's HTTP front and its engine process: typed messages over one local socket pair.

The front starts the engine process (`hybridpd.server.engine_process`) with one end of a socket pair and sends it
the node's configs; the engine process answers `EngineStarted` (or `StartFailed`) and from then on:

  front -> engine: Submit, Abort, ResetPrefixCache, ScrapeMetrics, ReleaseLease, Drain
  engine -> front: Outputs (one per engine step: every output of the step), Rejected, Aborted, EngineFailed,
                   MetricsText, Drained, and a Heartbeat every second from a thread of its own (the front's
                   watchdog: server/watchdog.py)

Messages are pickled (`multiprocessing.connection.Connection`); both ends are this package at one version, in one
pod. Errors that cross it are reduced to types both ends can rebuild (`portable_error`).
"""

from __future__ import annotations

import pickle
import threading
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection

from hybridpd.engine.model.generation_config import GenerationDefaults
from hybridpd.engine.request import EngineRequest, RequestOutput
from hybridpd.errors import HybridPDError
from hybridpd.kv_events.groups import GroupInfo


# -- front -> engine ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Submit:
    request: EngineRequest


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class ResetPrefixCache:
    pass


@dataclass(frozen=True)
class ScrapeMetrics:
    nonce: int


@dataclass(frozen=True)
class ReleaseLease:
    """End the lease on `request_id` if `secret` is its holder's (server/lease_routes.py)."""
    request_id: str
    secret: str = field(repr=False)


@dataclass(frozen=True)
class Drain:
    """Shut down: let decoders release their leases within `grace` seconds, abort what is left, stop, answer
    `Drained`, exit."""
    grace: float


# -- engine -> front ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineInfo:
    engine_id: str
    max_model_len: int
    vocab_size: int
    generation_defaults: GenerationDefaults
    groups: tuple[GroupInfo, ...]
    side_channel_port: int


@dataclass(frozen=True)
class EngineStarted:
    info: EngineInfo


@dataclass(frozen=True)
class StartFailed:
    message: str
    bad_configuration: bool  # a checkpoint or cache configuration that cannot work (the CLI exits 2)


@dataclass(frozen=True)
class Outputs:
    outputs: list[RequestOutput]


@dataclass(frozen=True)
class Rejected:
    request_id: str
    error: Exception


@dataclass(frozen=True)
class Aborted:
    request_id: str


@dataclass(frozen=True)
class EngineFailed:
    reason: str


@dataclass(frozen=True)
class MetricsText:
    nonce: int
    text: bytes


@dataclass(frozen=True)
class Heartbeat:
    """The engine process is alive (sent by a thread beside the engine thread): the steps its engine has taken so
    far, and whether work is waiting for it."""
    steps: int
    busy: bool


@dataclass(frozen=True)
class Drained:
    released: int  # leases released at shutdown


def portable_error(error: Exception) -> Exception:
    """`error` itself when the other end can rebuild it (ours, or a builtin one); otherwise a RuntimeError that keeps
    its type's name and message (it maps to HTTP 500 as the original would)."""
    if isinstance(error, HybridPDError) or type(error).__module__ == "builtins":
        try:
            pickle.loads(pickle.dumps(error))
            return error
        except Exception:  # noqa: BLE001 - an error whose arguments do not round-trip
            pass
    return RuntimeError(f"{type(error).__name__}: {error}")


def portable_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    return [out if out.error is None else replace(out, error=portable_error(out.error)) for out in outputs]


class LinkEnd:
    """One end of the link: `send` from any thread (one lock), `recv` from one reader thread."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._lock = threading.Lock()

    def send(self, message: object) -> None:
        with self._lock:
            self._connection.send(message)

    def recv(self) -> object:
        """The next message; EOFError once the other end (or this one) has closed."""
        if self._connection.closed:
            raise EOFError("the engine link is closed")
        return self._connection.recv()

    def close(self) -> None:
        self._connection.close()
