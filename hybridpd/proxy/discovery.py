"""Nodes from DNS: a role's name is resolved every `--dns-interval` seconds; every A/AAAA record is a node.

This is how a Kubernetes headless Service presents its ready pods (deploy/k8s/): scaling a pool with `kubectl scale`
adds or removes records, and the proxy follows without a restart. A node that joins gets calls from the next pick;
a node that leaves gets no new calls, and the calls it already has finish. A name that does not exist (NXDOMAIN) or
has no address is an empty pool (requests of that role get a 503 naming it); a resolver that does not answer keeps
the last known pool, so a DNS hiccup never empties a working cluster.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import dns.asyncresolver
import dns.exception
import dns.resolver

from hybridpd.proxy.config import DnsSource, Upstream
from hybridpd.proxy.routing import Router

logger = logging.getLogger(__name__)

_RECORD_TYPES = ("A", "AAAA")


class DnsResolver:
    """Addresses of a name: the system's resolver, or one DNS server (`--dns-server HOST:PORT`)."""

    def __init__(self, server: tuple[str, int] | None, timeout: float) -> None:
        self._resolver = dns.asyncresolver.Resolver(configure=server is None)
        if server is not None:
            self._resolver.nameservers = [server[0]]
            self._resolver.port = server[1]
        self._resolver.lifetime = timeout

    async def addresses(self, name: str) -> tuple[str, ...] | None:
        """The sorted addresses of `name` (empty: it has none); None when the resolver could not answer."""
        found: set[str] = set()
        for record_type in _RECORD_TYPES:
            try:
                answer = await self._resolver.resolve(name, record_type, search=True)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue
            except (dns.exception.Timeout, dns.resolver.NoNameservers) as exc:
                logger.warning("DNS lookup of %s (%s) failed: %s; keeping the last known nodes", name, record_type, exc)
                return None
            found.update(record.address for record in answer)
        return tuple(sorted(found))


class DnsDiscovery:
    """Keeps one router's upstreams equal to the records of one DNS name."""

    def __init__(self, source: DnsSource, router: Router, resolver: DnsResolver) -> None:
        self.source = source
        self._router = router
        self._resolver = resolver

    async def refresh(self) -> None:
        addresses = await self._resolver.addresses(self.source.name)
        if addresses is None:
            return
        upstreams = tuple(Upstream(role=self.source.role, host=a, port=self.source.port) for a in addresses)
        before = set(self._router.upstreams)
        joined = [u.address for u in upstreams if u not in before]
        left = [u.address for u in before if u not in set(upstreams)]
        if joined or left:
            logger.info("%s nodes from %s: joined %s, left %s", self.source.role.value, self.source.name, joined, left)
        self._router.replace(upstreams)


class Refreshable(Protocol):
    async def refresh(self) -> None: ...


async def refresh_all(discoveries: tuple[Refreshable, ...]) -> None:
    """Refresh every discovery once (DNS names, the nodes file)."""
    await asyncio.gather(*(d.refresh() for d in discoveries))
