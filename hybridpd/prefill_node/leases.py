"""Leases on the blocks a prefill node holds for remote decoders.

A lease is HELD from the moment the prompt is computed (and its first token sampled) until the decoder releases it or it
expires; only then are its blocks freed (they stay in the prefix cache). Blocks under a HELD lease are never
reused, so a READ that the decoder finishes before a successful `release` saw valid data. Finished leases are
remembered (boundedly) so that a late heartbeat or release gets a precise reason.

Only the holder may renew or release a lease: `add` draws a per-lease secret, which the prefill node hands out in
its `kv_transfer_params` answer (`remote_lease_secret`) and which every Heartbeat and Release must present. A request
that carries another request's `remote_request_id` without its secret (tampered or replayed params) can neither
keep nor end that lease.

Expiry runs on a monotonic clock (`time.monotonic` in a node): a wall-clock step must never end a lease early, or
its blocks could be reused while a READ runs. What crosses the wire (`remote_lease_expiry`, a heartbeat's answer)
is converted to unix time by `unix_time`.
"""

from __future__ import annotations

import enum
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

_REMEMBERED = 4096


class LeaseState(enum.Enum):
    HELD = "held"
    RELEASED = "released"
    EXPIRED = "expired"


@dataclass(frozen=True, kw_only=True)
class Lease:
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]   # per group: exactly what the decoder may read
    num_tokens: int
    prompt_digest: bytes = b""                # connector.lease_view.prompt_digest of those tokens
    expiry: float
    state: LeaseState = LeaseState.HELD
    secret: str = ""                          # what a holder presents to renew or release it


class LeaseTable:
    """Thread-safe: the engine thread adds leases, the event loop renews, releases and expires them."""

    def __init__(self, lease_seconds: float, clock: Callable[[], float], *, remembered: int = _REMEMBERED) -> None:
        self.lease_seconds = lease_seconds
        self.clock = clock
        self.remembered = remembered
        self._lock = threading.Lock()
        self._held: dict[str, Lease] = {}
        self._done: OrderedDict[str, LeaseState] = OrderedDict()
        self.num_expired = 0

    def unix_time(self, expiry: float) -> float:
        """A lease's `expiry` (on this table's clock) as unix time, for the wire."""
        return time.time() + (expiry - self.clock())

    def add(self, request_id: str, block_ids: tuple[tuple[int, ...], ...], num_tokens: int,
            prompt_digest: bytes = b"") -> Lease:
        lease = Lease(request_id=request_id, block_ids=block_ids, num_tokens=num_tokens, prompt_digest=prompt_digest,
                      expiry=self.clock() + self.lease_seconds, secret=secrets.token_hex(16))
        with self._lock:
            self._held[request_id] = lease
            self._done.pop(request_id, None)
        return lease

    def renew(self, request_id: str, secret: str) -> Lease:
        """Extend a live lease its holder asks for; raises LookupError naming why it cannot be renewed."""
        with self._lock:
            lease = self._held_by(request_id, secret)
            lease = replace(lease, expiry=self.clock() + self.lease_seconds)
            self._held[request_id] = lease
            return lease

    def release(self, request_id: str, secret: str) -> Lease | None:
        """End a lease its holder releases; returns it if it was still live (its blocks must now be freed), else
        None (unknown, already ended, or asked without the lease's secret: then it stays held)."""
        with self._lock:
            try:
                lease = self._held_by(request_id, secret)
            except LookupError:
                return None
            del self._held[request_id]
            self._remember(request_id, LeaseState.RELEASED)
            return lease

    def expire_due(self) -> list[Lease]:
        """End every lease past its expiry; returns them (their blocks must now be freed)."""
        now = self.clock()
        with self._lock:
            due = [lease for lease in self._held.values() if lease.expiry <= now]
            for lease in due:
                del self._held[lease.request_id]
                self._remember(lease.request_id, LeaseState.EXPIRED)
            self.num_expired += len(due)
            return due

    def drain(self) -> list[Lease]:
        """End every lease (shutdown)."""
        with self._lock:
            leases = list(self._held.values())
            for lease in leases:
                self._remember(lease.request_id, LeaseState.RELEASED)
            self._held.clear()
            return leases

    def next_expiry(self) -> float | None:
        with self._lock:
            return min((lease.expiry for lease in self._held.values()), default=None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def __contains__(self, request_id: object) -> bool:
        """Whether a lease is held for `request_id` (expired or not: the sweeper ends it)."""
        with self._lock:
            return request_id in self._held

    def _live(self, request_id: str) -> Lease:
        lease = self._held.get(request_id)
        if lease is not None and lease.expiry > self.clock():
            return lease
        if lease is not None:
            raise LookupError(f"the lease on request {request_id} has expired")
        state = self._done.get(request_id)
        if state is None:
            raise LookupError(f"no lease is held for request {request_id}")
        raise LookupError(f"the lease on request {request_id} was already {state.value}")

    def _held_by(self, request_id: str, secret: str) -> Lease:
        lease = self._live(request_id)
        if not hmac.compare_digest(lease.secret.encode(), secret.encode()):
            raise LookupError(f"the lease on request {request_id} is held by another request (wrong lease secret)")
        return lease

    def _remember(self, request_id: str, state: LeaseState) -> None:
        self._done.pop(request_id, None)   # a reused id counts as the newest, so the bound evicts older ones
        self._done[request_id] = state
        while len(self._done) > self.remembered:
            self._done.popitem(last=False)
