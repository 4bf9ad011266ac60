"""The gRPC side channel server, run on the node's asyncio loop (`grpc.aio`).

It answers `KVTransfer` (GetMetadata, Heartbeat, Release) through a `SideChannelHandler` that the prefill role
implements, plus the standard `grpc.health.v1.Health` service (no token needed). With a cluster token
configured, every KVTransfer call must carry `authorization: Bearer <token>`, else UNAUTHENTICATED.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Mapping
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from hybridpd.connector.lease_view import LeaseView
from hybridpd.connector.side_channel_auth import is_authorized
from hybridpd.connector.trusted_peers import TrustedPeers
from hybridpd.proto import kv_transfer_pb2 as pb
from hybridpd.proto import kv_transfer_pb2_grpc as pb_grpc
from hybridpd.tracing import carrier_of

log = logging.getLogger(__name__)

SERVICE_NAME = "hybridpd.kv_transfer.KVTransfer"


class SideChannelHandler(Protocol):
    """What the prefill role answers. Called on the event loop: each method must return promptly."""

    def metadata(self) -> pb.NodeMetadata: ...

    def heartbeat(self, request_id: str, secret: str, trace: Mapping[str, str] = {}) -> LeaseView | None:
        """Extends the lease and returns it (new expiry, leased blocks); None if unknown or already expired, or
        raises LookupError whose message says why (expired, already released, never held, another holder's): the
        reader sees it. `secret` is the lease's own (only its holder may renew or release it). `trace`: the caller's
        W3C trace headers (hybridpd/tracing.py), empty when it traces nothing."""
        ...

    def release(self, request_id: str, aborted: bool, secret: str) -> bool:
        """Ends the lease; True only if it was still live (so a READ before this call saw valid data)."""
        ...


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string: `ipv4:127.0.0.1:5555` -> `127.0.0.1`, `ipv6:%5B::1%5D:5555` -> `::1`."""
    address = urllib.parse.unquote(peer.split(":", 1)[1] if peer.startswith(("ipv4:", "ipv6:")) else peer)
    host = address.rpartition(":")[0] or address
    return host.strip("[]")


class _KVTransferServicer(pb_grpc.KVTransferServicer):
    def __init__(self, handler: SideChannelHandler, cluster_token: str | None,
                 trusted_peers: TrustedPeers | None) -> None:
        self._handler = handler
        self._token = cluster_token
        self._trusted = trusted_peers

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if not is_authorized(context.invocation_metadata(), self._token):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")

    async def GetMetadata(self, request: pb.GetMetadataRequest, context: grpc.aio.ServicerContext) -> pb.NodeMetadata:
        """The transport metadata lets its holder READ all of this node's registered KV memory: only an
        authenticated peer inside `--kv-trusted-peers` gets it."""
        await self._authorize(context)
        peer = peer_host(context.peer())
        if self._trusted is not None and not self._trusted.allows(peer):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{peer} is not a trusted peer of this node (--kv-trusted-peers)")
        return self._handler.metadata()

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatResponse:
        await self._authorize(context)
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        try:
            lease = self._handler.heartbeat(request.request_id, request.lease_secret,
                                            carrier_of(dict(context.invocation_metadata() or ())))
        except LookupError as exc:
            return pb.HeartbeatResponse(ok=False, reason=str(exc))
        if lease is None:
            return pb.HeartbeatResponse(ok=False, reason=f"no live lease for request {request.request_id}")
        return pb.HeartbeatResponse(ok=True, lease_expiry=lease.expiry, num_tokens=lease.num_tokens,
                                    prompt_digest=lease.prompt_digest, lease_seconds_left=lease.seconds_left,
                                    block_ids=[pb.BlockIds(ids=ids) for ids in lease.block_ids])

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.ReleaseResponse:
        await self._authorize(context)
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        if request.status == pb.ReleaseRequest.STATUS_UNSPECIFIED:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "status must be DONE or ABORTED")
        aborted = request.status == pb.ReleaseRequest.ABORTED
        return pb.ReleaseResponse(lease_was_live=self._handler.release(request.request_id, aborted,
                                                                       request.lease_secret))


class SideChannelServer:
    def __init__(self, handler: SideChannelHandler, host: str, port: int, cluster_token: str | None,
                 trusted_peers: TrustedPeers | None = None,
                 credentials: grpc.ServerCredentials | None = None) -> None:
        """`trusted_peers`: who may ask for this node's transport metadata (None: anyone with the token)."""
        self._handler = handler
        self._trusted = trusted_peers
        self._credentials = credentials
        self._host = host
        self._requested_port = port
        self._token = cluster_token
        self._server: grpc.aio.Server | None = None
        self._health = health_aio.HealthServicer()
        self._port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the side channel server is not started")
        return self._port

    async def start(self) -> None:
        server = grpc.aio.server()
        pb_grpc.add_KVTransferServicer_to_server(_KVTransferServicer(self._handler, self._token, self._trusted),
                                                 server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        host = f"[{self._host}]" if ":" in self._host else self._host
        address = f"{host}:{self._requested_port}"
        if self._credentials is not None:
            port = server.add_secure_port(address, self._credentials)
        else:
            port = server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"side channel: cannot bind {self._host}:{self._requested_port}")
        await server.start()
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._server, self._port = server, port
        log.info("side channel listening on %s:%d (cluster token %s, TLS %s)", self._host, port,
                 "required" if self._token is not None else "off", "on" if self._credentials is not None else "off")

    async def stop(self, grace: float | None = None) -> None:
        if self._server is None:
            return
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace)
        self._server = None
