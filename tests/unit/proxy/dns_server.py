"""A real DNS server on 127.0.0.1 for discovery tests (dnslib): A records that a test adds and removes."""

from __future__ import annotations

import threading

from dnslib import QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer


class _Records(BaseResolver):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.a: dict[str, list[str]] = {}   # name (no trailing dot) -> addresses

    def resolve(self, request, handler):
        reply = request.reply()
        name = str(request.q.qname).rstrip(".")
        with self.lock:
            addresses = list(self.a.get(name, ()))
        if name not in self.a:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype == QTYPE.A:
            for address in addresses:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=0))
        return reply


class LocalDns:
    """`set(name, [addresses])`, `drop(name)`; serves UDP on 127.0.0.1:`port`."""

    def __init__(self) -> None:
        self._records = _Records()
        quiet = DNSLogger(log="-request,-reply,-truncated,-error,-recv,-send,-data", logf=lambda _: None)
        self._server = DNSServer(self._records, port=0, address="127.0.0.1", logger=quiet)
        self.port = self._server.server.server_address[1]

    def __enter__(self) -> LocalDns:
        self._server.start_thread()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop()
        self._server.server.server_close()

    def set(self, name: str, addresses: list[str]) -> None:
        with self._records.lock:
            self._records.a[name] = list(addresses)

    def drop(self, name: str) -> None:
        with self._records.lock:
            self._records.a.pop(name, None)
