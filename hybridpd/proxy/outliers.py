"""Outlier detection and active health for the proxy's nodes, the way Envoy and Kubernetes do it.

Every node is treated as suspect. Two sources of evidence, each with its own count of consecutive failures:
real calls (connect errors, timeouts, 5xx, broken streams: `call_failed` / `call_succeeded`; a refused
connection is conclusive and ejects at once) and active probes of
`/health` (`probe_failed` / `probe_passed`), which run on every node whether or not it takes traffic.

    HEALTHY --(calls or probes fail `threshold` times in a row)--> EJECTED(until now + ejection time)
    EJECTED --(its ejection time has passed)--> PROBING      (still no traffic)
    PROBING --(a probe passes)--> HEALTHY                    (PROBING --(a probe fails)--> EJECTED again)

The ejection time doubles with every ejection (base, 2 x base, ... at most `max_ejection_s`) and starts over once
the node has stayed healthy for `max_ejection_s`. A node that is not HEALTHY gets no calls while a healthy node of
its role is left (`available`); when none is, the router still tries one (it may be back). A node cannot flap back
on a stale success: successes seen while EJECTED or PROBING change nothing, only a probe that passes while PROBING
returns it.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Set as AbstractSet
from dataclasses import dataclass, replace


class NodeState(enum.Enum):
    HEALTHY = "healthy"
    EJECTED = "ejected"
    PROBING = "probing"


@dataclass(frozen=True, kw_only=True)
class OutlierPolicy:
    threshold: int = 3              # consecutive failures of calls (or of probes) that eject a node
    base_ejection_s: float = 2.0
    max_ejection_s: float = 30.0

    def __post_init__(self) -> None:
        if self.threshold < 1:
            raise ValueError(f"--eject-after must be >= 1, got {self.threshold}")
        if not 0 < self.base_ejection_s <= self.max_ejection_s:
            raise ValueError(f"ejection times must satisfy 0 < base ({self.base_ejection_s}) <= max "
                             f"({self.max_ejection_s})")


@dataclass(frozen=True, kw_only=True)
class NodeHealth:
    """One node's record (a value: every event returns a new one)."""

    state: NodeState = NodeState.HEALTHY
    call_failures: int = 0          # consecutive
    probe_failures: int = 0         # consecutive
    ejections: int = 0              # since the node was last stable; sets the next ejection time
    ejected_until: float = 0.0
    healthy_since: float = 0.0
    last_error: str = ""

    def to_json(self) -> dict[str, object]:
        return {"state": self.state.value, "consecutive_call_failures": self.call_failures,
                "consecutive_probe_failures": self.probe_failures, "ejections": self.ejections,
                "last_error": self.last_error}


class OutlierDetector:
    """The records of one role's nodes, keyed by anything hashable (the proxy's `Upstream`). Single-threaded: the
    proxy's event loop calls it. Records of nodes that left are dropped by `retain`, so the map stays bounded by the
    node list."""

    def __init__(self, policy: OutlierPolicy = OutlierPolicy(), clock: Callable[[], float] | None = None) -> None:
        self.policy = policy
        self._clock = clock or time.monotonic
        self._nodes: dict[object, NodeHealth] = {}
        self._unhealthy: set[object] = set()   # nodes whose record is not HEALTHY: only events move them in or out
        self.num_ejections = 0

    def health(self, node: object) -> NodeHealth:
        record = self._nodes.get(node)
        if record is None:
            record = self._nodes[node] = NodeHealth(healthy_since=self._clock())
        if record.state is NodeState.EJECTED and self._clock() >= record.ejected_until:
            record = self._nodes[node] = replace(record, state=NodeState.PROBING)   # unhealthy before and after
        return record

    def state(self, node: object) -> NodeState:
        return self.health(node).state

    def available(self, node: object) -> bool:
        return node not in self._unhealthy

    @property
    def unavailable(self) -> AbstractSet[object]:
        """The nodes that take no calls now (ejected or probing): a routing decision reads it once, not per node.
        Time alone moves a node only from EJECTED to PROBING, both unavailable, so events keep this exact."""
        return self._unhealthy

    def retain(self, nodes: set[object] | frozenset[object]) -> None:
        for gone in [n for n in self._nodes if n not in nodes]:
            del self._nodes[gone]
            self._unhealthy.discard(gone)

    # -- evidence ---------------------------------------------------------------------------------------------------
    def call_succeeded(self, node: object) -> None:
        record = self.health(node)
        if record.state is NodeState.HEALTHY:
            self._store(node, self._stable(replace(record, call_failures=0)))

    def call_failed(self, node: object, reason: str, *, conclusive: bool = False) -> None:
        """A failed call; a `conclusive` one (the connection was refused: nothing listens there) ejects at once."""
        record = self.health(node)
        if record.state is not NodeState.HEALTHY:
            self._store(node, replace(record, last_error=reason))
            return
        record = replace(record, call_failures=record.call_failures + 1, last_error=reason)
        due = conclusive or record.call_failures >= self.policy.threshold
        self._store(node, self._eject(record) if due else record)

    def probe_passed(self, node: object) -> None:
        record = self.health(node)
        if record.state is NodeState.PROBING:
            record = replace(record, state=NodeState.HEALTHY, call_failures=0, probe_failures=0,
                             healthy_since=self._clock())
        elif record.state is NodeState.HEALTHY:
            record = self._stable(replace(record, probe_failures=0))
        self._store(node, record)

    def probe_failed(self, node: object, reason: str) -> None:
        record = self.health(node)
        if record.state is NodeState.PROBING:
            self._store(node, self._eject(replace(record, last_error=reason)))
        elif record.state is NodeState.EJECTED:
            self._store(node, replace(record, last_error=reason))
        else:
            record = replace(record, probe_failures=record.probe_failures + 1, last_error=reason)
            self._store(node, self._eject(record) if record.probe_failures >= self.policy.threshold else record)

    # -- transitions ------------------------------------------------------------------------------------------------
    def _eject(self, record: NodeHealth) -> NodeHealth:
        seconds = min(self.policy.max_ejection_s, self.policy.base_ejection_s * 2 ** record.ejections)
        self.num_ejections += 1
        return replace(record, state=NodeState.EJECTED, ejections=record.ejections + 1,
                       ejected_until=self._clock() + seconds, call_failures=0, probe_failures=0)

    def _stable(self, record: NodeHealth) -> NodeHealth:
        """A node healthy for `max_ejection_s` starts its ejection times over."""
        if record.ejections and self._clock() - record.healthy_since >= self.policy.max_ejection_s:
            return replace(record, ejections=0)
        return record

    def _store(self, node: object, record: NodeHealth) -> None:
        self._nodes[node] = record
        if record.state is NodeState.HEALTHY:
            self._unhealthy.discard(node)
        else:
            self._unhealthy.add(node)
