"""Nodes from a file the proxy watches (`--nodes-file PATH`): `{"prefill": ["host:port", ...], "decode": [...]}`.

Re-read whenever its modification time or size changes (checked every `--dns-interval` seconds): an operator or a
script scales the cluster by rewriting the file, with no proxy restart. A file that cannot be read or parsed leaves
the last good node lists in place (and says why in the log); a role missing from the file has no nodes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from hybridpd.proxy.config import Role, Upstream
from hybridpd.proxy.routing import Router

logger = logging.getLogger(__name__)

_KEYS = {Role.PREFILL: "prefill", Role.DECODE: "decode"}


def parse_nodes(text: str) -> dict[Role, tuple[Upstream, ...]]:
    """Raises ValueError naming what is wrong."""
    raw = json.loads(text)
    if not isinstance(raw, dict) or set(raw) - set(_KEYS.values()):
        raise ValueError('a nodes file is a JSON object {"prefill": ["host:port", ...], "decode": [...]}')
    nodes: dict[Role, tuple[Upstream, ...]] = {}
    for role, key in _KEYS.items():
        entries = raw.get(key, [])
        if not isinstance(entries, list):
            raise ValueError(f"{key} must be a list of \"host:port\" strings")
        upstreams = []
        for entry in entries:
            host, sep, port = str(entry).rpartition(":")
            if not isinstance(entry, str) or not sep or not host or not port.isdigit():
                raise ValueError(f"{key}: {entry!r} is not \"host:port\"")
            upstreams.append(Upstream(role=role, host=host.strip("[]"), port=int(port)))
        nodes[role] = tuple(upstreams)
    return nodes


class NodesFile:
    """Keeps the routers' upstreams equal to the file's lists."""

    def __init__(self, path: Path, routers: dict[Role, Router]) -> None:
        self.path = path
        self._routers = routers
        self._stamp: tuple[int, int] | None = None

    async def refresh(self) -> None:
        try:
            stat = self.path.stat()
            stamp = (stat.st_mtime_ns, stat.st_size)
            if stamp == self._stamp:
                return
            nodes = parse_nodes(self.path.read_text())
        except (OSError, ValueError) as exc:
            logger.warning("nodes file %s: %s; keeping the last known nodes", self.path, exc)
            return
        self._stamp = stamp
        for role, upstreams in nodes.items():
            if upstreams != self._routers[role].upstreams:
                logger.info("nodes file %s: %s nodes now %s", self.path, role.value, [u.address for u in upstreams])
            self._routers[role].replace(upstreams)
