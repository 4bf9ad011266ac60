"""Which node of a role gets the next call: round robin, or the one with the fewest calls in flight."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator

from hybridpd.proxy.config import RoutingPolicy, Upstream


class NoUpstreamError(LookupError):
    """Every upstream of the role is excluded (all of them already failed this request)."""


class Router:
    """Picks an upstream of one role and counts the calls in flight on each.

    Round robin: the upstreams in turn, starting after the last one picked. Least outstanding: the
    fewest calls in flight; ties go to the first in round-robin order, so an idle cluster still
    spreads calls. `exclude` skips upstreams that already failed this request (the retry path).
    Single-threaded by design: all calls happen on the proxy's event loop.
    """

    def __init__(self, upstreams: tuple[Upstream, ...], policy: RoutingPolicy) -> None:
        if not upstreams:
            raise ValueError("a router needs at least one upstream")
        self._upstreams = upstreams
        self._policy = policy
        self._outstanding = [0] * len(upstreams)
        self._next = 0  # index where the round-robin order starts

    @property
    def upstreams(self) -> tuple[Upstream, ...]:
        return self._upstreams

    def outstanding(self, upstream: Upstream) -> int:
        return self._outstanding[self._upstreams.index(upstream)]

    def pick(self, exclude: Collection[Upstream] = ()) -> Upstream:
        count = len(self._upstreams)
        order = [(self._next + k) % count for k in range(count)]
        candidates = [i for i in order if self._upstreams[i] not in exclude]
        if not candidates:
            raise NoUpstreamError("no upstream left to try")
        if self._policy is RoutingPolicy.LEAST_OUTSTANDING:
            chosen = min(candidates, key=lambda i: self._outstanding[i])  # min keeps the first of equals
        else:
            chosen = candidates[0]
        self._next = (chosen + 1) % count
        return self._upstreams[chosen]

    @contextlib.contextmanager
    def in_flight(self, upstream: Upstream) -> Iterator[None]:
        """Counts one call to `upstream` as outstanding for the duration of the block."""
        index = self._upstreams.index(upstream)
        self._outstanding[index] += 1
        try:
            yield
        finally:
            self._outstanding[index] -= 1
