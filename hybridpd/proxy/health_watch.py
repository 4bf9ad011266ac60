"""Brings nodes that were marked down back: every `interval` seconds, each down node's `/health` is probed, and a
200 marks it up in its router (a node restarted by `hybridpd up`, or a pod that came back, takes calls again)."""

from __future__ import annotations

import asyncio
import logging

from hybridpd.proxy.routing import Router
from hybridpd.proxy.upstream import UpstreamClient

logger = logging.getLogger(__name__)


async def revive_once(routers: tuple[Router, ...], client: UpstreamClient) -> None:
    for router in routers:
        down = sorted(router.down, key=lambda u: u.address)
        answers = await asyncio.gather(*(client.probe(u) for u in down))
        for upstream, (status, _) in zip(down, answers):
            if status == 200:
                router.mark_up(upstream)
                logger.info("%s answers /health again: it takes calls again", upstream.name)
