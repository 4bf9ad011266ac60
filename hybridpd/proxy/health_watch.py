"""Active health: every `--probe-interval` seconds, every node of every role is probed (`GET /health`, short
timeout), whether it takes calls or not, and each answer goes to its router's outlier detector (proxy/outliers.py):
a 200 passes, anything else (no answer, a timeout, a 503 from a node whose engine is dead or wedged) fails. An
ejected node returns once its ejection time has passed and a probe passes."""

from __future__ import annotations

import asyncio
import logging

from hybridpd.proxy.outliers import NodeState
from hybridpd.proxy.routing import Router
from hybridpd.proxy.upstream import UpstreamClient

logger = logging.getLogger(__name__)


async def probe_all(routers: tuple[Router, ...], client: UpstreamClient) -> None:
    for router in routers:
        nodes = router.upstreams
        answers = await asyncio.gather(*(client.probe(u) for u in nodes))
        for upstream, (status, detail) in zip(nodes, answers):
            before = router.outliers.state(upstream)
            if status == 200:
                router.outliers.probe_passed(upstream)
            else:
                router.outliers.probe_failed(upstream, f"probe: {detail}")
            after = router.outliers.state(upstream)
            if after is not before and NodeState.PROBING not in (before, after):
                logger.warning("%s is now %s (%s)", upstream.name, after.value,
                               router.outliers.health(upstream).last_error or "probe passed")
