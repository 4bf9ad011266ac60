"""Which node of a role gets the next call: round robin, or the one with the fewest calls in flight.

The set of nodes can change while the proxy runs (DNS discovery, proxy/discovery.py): `replace` installs a new
tuple; calls already in flight on a node that left finish where they are and are still counted until they end.
Each router keeps an outlier detector (proxy/outliers.py) of its nodes: a node that is not HEALTHY (ejected after
failed calls or probes, or still probing) gets no new calls while a healthy node of its role is left.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator, Sequence

from hybridpd.proxy.config import RoutingPolicy, Upstream
from hybridpd.proxy.outliers import OutlierDetector, OutlierPolicy


class NoUpstreamError(LookupError):
    """No upstream of the role can take the call: none is known, or all of them already failed this request."""


class Router:
    """Picks an upstream of one role and counts the calls in flight on each.

    Round robin: the upstreams in turn, starting after the last one picked. Least outstanding: the
    fewest calls in flight; ties go to the first in round-robin order, so an idle cluster still
    spreads calls. Cache aware: the lowest of the `costs` the caller gives (proxy/cache_aware.py), ties likewise;
    without costs (nothing known of the prompt) it is least outstanding. `exclude` skips upstreams that already failed
    this request (the retry path). Each call in flight may carry `work_tokens` (the prompt tokens it makes the node
    compute), summed per upstream as `queued_tokens`.
    Single-threaded by design: all calls happen on the proxy's event loop.
    """

    def __init__(self, upstreams: tuple[Upstream, ...], policy: RoutingPolicy, role_name: str = "",
                 outliers: OutlierDetector | None = None) -> None:
        self._role_name = role_name or (upstreams[0].role.value if upstreams else "upstream")
        self._upstreams = upstreams
        self._position = {u: i for i, u in enumerate(upstreams)}
        self._policy = policy
        self._outstanding: dict[Upstream, int] = {}
        self._queued_tokens: dict[Upstream, int] = {}
        self.outliers = outliers if outliers is not None else OutlierDetector(OutlierPolicy())
        self._next = 0  # index where the round-robin order starts

    @property
    def upstreams(self) -> tuple[Upstream, ...]:
        return self._upstreams

    def replace(self, upstreams: tuple[Upstream, ...]) -> None:
        """The role's nodes are now `upstreams` (in-flight counts of nodes that stay are kept)."""
        if upstreams != self._upstreams:
            self._upstreams = upstreams
            self._position = {u: i for i, u in enumerate(upstreams)}
            self._next = self._next % len(upstreams) if upstreams else 0
            self.outliers.retain(set(upstreams))

    @property
    def down(self) -> frozenset[Upstream]:
        """The nodes that take no calls now (ejected or probing)."""
        down = self.outliers.unavailable
        return frozenset(u for u in self._upstreams if u in down)

    @property
    def policy(self) -> RoutingPolicy:
        return self._policy

    def outstanding(self, upstream: Upstream) -> int:
        return self._outstanding.get(upstream, 0)

    def queued_tokens(self, upstream: Upstream) -> int:
        return self._queued_tokens.get(upstream, 0)

    def loads(self) -> tuple[list[int], list[int]]:
        """The calls in flight and the queued tokens of each upstream, in `upstreams` order: what a cost rule reads
        of every upstream at every decision, in two lists."""
        return self._per_position(self._outstanding), self._per_position(self._queued_tokens)

    def _per_position(self, counts: dict[Upstream, int]) -> list[int]:
        """`counts` (only upstreams with calls in flight are in it) as a list in `upstreams` order."""
        out, position = [0] * len(self._upstreams), self._position
        for upstream, count in counts.items():
            i = position.get(upstream)
            if i is not None:   # a node that left may still finish calls: counted, but not routed to
                out[i] = count
        return out

    def pick(self, exclude: Collection[Upstream] = (), costs: Sequence[float] | None = None) -> Upstream:
        """`costs`: one per upstream, in `upstreams` order (cache aware: the lowest wins)."""
        upstreams, count = self._upstreams, len(self._upstreams)
        order = [*range(self._next, count), *range(self._next)]
        candidates = [i for i in order if upstreams[i] not in exclude] if exclude else order
        down = self.outliers.unavailable
        if down:
            candidates = [i for i in candidates if upstreams[i] not in down] or candidates  # all down: try one anyway
        if not candidates:
            role = self._role_name
            raise NoUpstreamError(f"no {role} node known" if not count else f"no {role} node left to try")
        if self._policy is RoutingPolicy.CACHE_AWARE and costs is not None:
            chosen = min(candidates, key=costs.__getitem__)  # min keeps the first
        elif self._policy is not RoutingPolicy.ROUND_ROBIN:
            chosen = min(candidates, key=self._per_position(self._outstanding).__getitem__)
        else:
            chosen = candidates[0]
        self._next = (chosen + 1) % count
        return self._upstreams[chosen]

    @contextlib.contextmanager
    def in_flight(self, upstream: Upstream, work_tokens: int = 0) -> Iterator[Callable[[], None]]:
        """Counts one call to `upstream` as outstanding for the duration of the block, and its `work_tokens` as
        queued until the block exits or calls what it is given (the node has done that work: its first token came)."""
        _add(self._outstanding, upstream, 1)
        _add(self._queued_tokens, upstream, work_tokens)
        queued = work_tokens

        def work_done() -> None:
            nonlocal queued
            _add(self._queued_tokens, upstream, -queued)
            queued = 0

        try:
            yield work_done
        finally:
            _add(self._outstanding, upstream, -1)
            work_done()


def _add(counts: dict[Upstream, int], upstream: Upstream, delta: int) -> None:
    left = counts.get(upstream, 0) + delta
    if left:
        counts[upstream] = left
    else:
        counts.pop(upstream, None)
