"""Free ports for a local cluster, so tests and the demo never collide with what already runs."""

from __future__ import annotations

import random
import socket

from hybridpd.launcher.errors import ClusterError
from hybridpd.launcher.spec import EVENTS_PORT_OFFSET, KV_PORT_OFFSET, REPLAY_PORT_OFFSET

_ATTEMPTS = 200
# Below Linux's ephemeral range (32768-60999): a port the OS hands out for an outgoing connection can never take
# one chosen here between the check and the bind.
_LOW, _HIGH = 20000, 32767


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, below the ephemeral range (bound, then released); the OS's choice if none is found."""
    rng = random.Random()
    for _ in range(_ATTEMPTS):
        port = rng.randrange(_LOW, _HIGH)
        if _bindable(host, port):
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_cluster_ports(num_nodes: int, host: str = "127.0.0.1", *, kv_events: bool = False) -> tuple[int, int]:
    """(proxy port, base port) such that the proxy port, base..base+n-1 and their side-channel ports
    (base+1000..; with `kv_events` also the event ports base+2000.. and base+3000..) are all free now. Another
    process may still take one before the cluster binds it: the launcher then fails with that node's log, and a
    caller can retry."""
    rng = random.Random()
    offsets = (0, KV_PORT_OFFSET, EVENTS_PORT_OFFSET, REPLAY_PORT_OFFSET) if kv_events else (0, KV_PORT_OFFSET)
    for _ in range(_ATTEMPTS):
        base = rng.randrange(_LOW, _HIGH - offsets[-1] - num_nodes)
        proxy = base - 1
        ports = [proxy, *(base + offset + i for offset in offsets for i in range(num_nodes))]
        if all(_bindable(host, port) for port in ports):
            return proxy, base
    raise ClusterError(f"no free range of ports for {num_nodes} nodes after {_ATTEMPTS} attempts")
