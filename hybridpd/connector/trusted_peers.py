"""Which prefill nodes a decode node may pull from (`--kv-trusted-peers`).

Pulled blocks enter the decode node's prefix cache, and `remote_host`/`remote_port` come from the request: without
this check any client that can reach the node's HTTP port could point it at a side channel of its own and plant KV
that later requests hit. A peer is trusted when its `remote_host` is an address inside one of the listed networks
(CIDR or single address) or is literally one of the listed host names. Default: loopback only.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
LOOPBACK_ONLY = ("127.0.0.0/8", "::1", "localhost")
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?")


@dataclass(frozen=True, kw_only=True)
class TrustedPeers:
    networks: tuple[IPNetwork, ...]
    hosts: frozenset[str]

    @classmethod
    def parse(cls, entries: Iterable[str]) -> TrustedPeers:
        """Entries are CIDRs, addresses or host names; one argument may hold several, comma-separated."""
        networks: list[IPNetwork] = []
        hosts: set[str] = set()
        for entry in (part.strip() for item in entries for part in item.split(",")):
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                if not all(_LABEL.fullmatch(label) for label in entry.split(".")):
                    raise ValueError(f"--kv-trusted-peers: {entry!r} is neither a CIDR, an address nor a host name")
                hosts.add(entry.lower())
        if not networks and not hosts:
            raise ValueError("--kv-trusted-peers needs at least one CIDR, address or host name")
        return cls(networks=tuple(networks), hosts=frozenset(hosts))

    def allows(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return host.lower() in self.hosts
        return any(address in network for network in self.networks)

    def describe(self) -> str:
        return ", ".join([*(str(n) for n in self.networks), *sorted(self.hosts)])
