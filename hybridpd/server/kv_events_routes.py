"""The node's KV event routes: where its events are published (`GET /kv_events`, and vLLM's `GET /kv_event_sources`)
and `POST /reset_prefix_cache`.

`GET /kv_events` tells a consumer (the proxy's cache-aware routing) the PUB and replay addresses, with the
wildcard host replaced by the node's advertised host; the topic; this process's instance id (a restarted node has a
new one and numbers its batches from 0 again); the groups (index, kind, block size, window, as vLLM's
`kv_cache_spec_*` fields); and how block hashes are computed, so the consumer hashes a prompt the same way.
404 when the node publishes no events.

`GET /kv_event_sources` is vLLM's: the publisher's config per data-parallel rank (`{"0": {...}}`, the one rank here;
`{}` when nothing is published), its fields those of `--kv-events-config`, the endpoints as a peer reaches them (vLLM
shows a bound wildcard as configured).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence
from dataclasses import asdict

from aiohttp import web

from hybridpd.errors import NotFoundError, UnauthorizedError
from hybridpd.kv_events.config import KVEventsConfig, binds
from hybridpd.kv_events.groups import GroupInfo
from hybridpd.wire_headers import CLUSTER_TOKEN_HEADER

HASH_SCHEME = "hybridpd-blake2b256-chain-v1"  # engine/kv_cache/hashing.py; cache_salt as UTF-8 bytes


def advertised(endpoint: str | None, host: str) -> str | None:
    """`tcp://*:5557` as a peer reaches it: `tcp://HOST:5557`."""
    if endpoint is None:
        return None
    return endpoint.replace("*", host, 1) if endpoint.startswith("tcp://*") else endpoint


def kv_events_routes(config: KVEventsConfig, groups: Sequence[GroupInfo], *, host: str, instance_id: str,
                     reset_prefix_cache: Callable[[], object], cluster_token: str | None) -> list[web.RouteDef]:
    async def info(request: web.Request) -> web.Response:
        if not config.publishes:
            raise NotFoundError("this node publishes no KV events (start it with --kv-events-config)")
        return web.json_response({
            "endpoint": advertised(config.endpoint, host) if binds(config.endpoint) else None,
            "replay_endpoint": advertised(config.replay_endpoint, host),
            "topic": config.topic,
            "instance_id": instance_id,
            "hash_scheme": HASH_SCHEME,
            "groups": [g.as_json() for g in groups],
        })

    async def sources(request: web.Request) -> web.Response:
        if not config.publishes:
            return web.json_response({})
        published = {**asdict(config), "endpoint": advertised(config.endpoint, host),
                     "replay_endpoint": advertised(config.replay_endpoint, host)}
        return web.json_response({"0": published})

    async def reset(request: web.Request) -> web.Response:
        if cluster_token is not None:
            sent = request.headers.get(CLUSTER_TOKEN_HEADER, "")
            if not hmac.compare_digest(sent.encode("utf-8", "surrogateescape"), cluster_token.encode("utf-8")):
                raise UnauthorizedError(f"/reset_prefix_cache needs a valid {CLUSTER_TOKEN_HEADER} header")
        reset_prefix_cache()
        return web.Response(status=200)

    return [web.get("/kv_events", info), web.get("/kv_event_sources", sources),
            web.post("/reset_prefix_cache", reset)]
