"""The gRPC side channel client: one per peer, one channel reused for every call to that peer.

Every failure becomes `KVTransferError(peer, reason)` with a reason a person can act on: unreachable,
no answer within the timeout, token rejected, no live lease.
"""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from hybridpd.connector.side_channel_auth import bearer_metadata
from hybridpd.connector.lease_view import LeaseView
from hybridpd.errors import KVTransferError
from hybridpd.proto import kv_transfer_pb2 as pb
from hybridpd.proto import kv_transfer_pb2_grpc as pb_grpc


class SideChannelClient:
    def __init__(self, host: str, port: int, cluster_token: str | None, timeout_s: float,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.peer = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._metadata = bearer_metadata(cluster_token)
        self._timeout_s = timeout_s
        self._credentials = credentials
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.KVTransferStub | None = None

    def __repr__(self) -> str:  # never shows the token
        return f"SideChannelClient(peer={self.peer!r}, timeout_s={self._timeout_s})"

    def _kv(self) -> pb_grpc.KVTransferStub:
        if self._stub is None:  # created lazily, inside the running event loop
            if self._credentials is not None:
                self._channel = grpc.aio.secure_channel(self.peer, self._credentials)
            else:
                self._channel = grpc.aio.insecure_channel(self.peer)
            self._stub = pb_grpc.KVTransferStub(self._channel)
        return self._stub

    def _error(self, e: grpc.aio.AioRpcError) -> KVTransferError:
        code = e.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            reason = f"side channel unreachable ({e.details()})"
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
            reason = f"side channel did not answer within {self._timeout_s:g}s"
        elif code == grpc.StatusCode.UNAUTHENTICATED:
            reason = "side channel rejected the cluster token: UNAUTHENTICATED (missing or different --cluster-token)"
        else:
            reason = f"side channel error {code.name}: {e.details()}"
        return KVTransferError(self.peer, reason)

    async def get_metadata(self, requester_engine_id: str = "") -> pb.NodeMetadata:
        request = pb.GetMetadataRequest(requester_engine_id=requester_engine_id)
        try:
            return await self._kv().GetMetadata(request, timeout=self._timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None

    async def heartbeat(self, request_id: str, secret: str, trace: Mapping[str, str] = {}) -> LeaseView:
        """Renew the lease (`secret`: the lease's own); raises KVTransferError when it is unknown, expired or
        another request's. `trace`: W3C trace headers sent as metadata, so the prefill node's span nests."""
        try:
            reply = await self._kv().Heartbeat(
                pb.HeartbeatRequest(request_id=request_id, lease_secret=secret), timeout=self._timeout_s,
                metadata=tuple(self._metadata or ()) + tuple(trace.items()),
            )
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None
        if not reply.ok:
            raise KVTransferError(self.peer, f"lease lost: {reply.reason}")
        return LeaseView(expiry=reply.lease_expiry, num_tokens=reply.num_tokens, prompt_digest=reply.prompt_digest,
                         block_ids=tuple(tuple(group.ids) for group in reply.block_ids),
                         seconds_left=reply.lease_seconds_left)

    async def release(self, request_id: str, aborted: bool, secret: str) -> bool:
        """True only if the lease was still live when released: a READ done before saw valid data."""
        status = pb.ReleaseRequest.ABORTED if aborted else pb.ReleaseRequest.DONE
        try:
            reply = await self._kv().Release(
                pb.ReleaseRequest(request_id=request_id, status=status, lease_secret=secret), timeout=self._timeout_s,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None
        return reply.lease_was_live

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel, self._stub = None, None
