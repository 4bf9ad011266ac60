"""The proxy's `/health`: every upstream probed at once; healthy only when all of them are."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import Any

from hybridpd.proxy.config import Upstream
from hybridpd.proxy.outliers import NodeHealth
from hybridpd.proxy.upstream import UpstreamClient


class UpstreamState(enum.Enum):
    HEALTHY = "healthy"          # GET /health answered 200
    UNHEALTHY = "unhealthy"      # it answered, but not 200 (starting up, shutting down, broken)
    UNREACHABLE = "unreachable"  # no answer at all


@dataclass(frozen=True, kw_only=True)
class UpstreamHealth:
    upstream: Upstream
    state: UpstreamState
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.upstream.role.value,
            "address": self.upstream.address,
            "state": self.state.value,
            "detail": self.detail,
        }


async def _check(client: UpstreamClient, upstream: Upstream) -> UpstreamHealth:
    status, detail = await client.probe(upstream)
    if status is None:
        state = UpstreamState.UNREACHABLE
    elif status == 200:
        state = UpstreamState.HEALTHY
    else:
        state = UpstreamState.UNHEALTHY
    return UpstreamHealth(upstream=upstream, state=state, detail=detail)


async def check_all(client: UpstreamClient, upstreams: tuple[Upstream, ...]) -> tuple[UpstreamHealth, ...]:
    return tuple(await asyncio.gather(*(_check(client, upstream) for upstream in upstreams)))


def health_body(report: tuple[UpstreamHealth, ...],
                records: dict[Upstream, NodeHealth] | None = None) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body): 200 only when every upstream is healthy, else 503. Each upstream also shows its record
    in the proxy's outlier detector (`routing`: healthy / ejected / probing, consecutive failures, last error)."""
    healthy = all(item.state is UpstreamState.HEALTHY for item in report)
    records = records or {}
    body = {
        "status": "healthy" if healthy else "unhealthy",
        "upstreams": [{**item.to_json(), **({"routing": records[item.upstream].to_json()}
                                            if item.upstream in records else {})} for item in report],
    }
    return (200 if healthy else 503), body
