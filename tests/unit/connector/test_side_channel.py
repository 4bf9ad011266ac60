"""Side channel server and client over 127.0.0.1 with a fake handler."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridpd.connector.side_channel_auth import bearer_metadata
from hybridpd.connector.lease_view import LeaseView
from hybridpd.connector.side_channel_client import SideChannelClient
from hybridpd.connector.side_channel_server import SideChannelServer
from hybridpd.errors import KVTransferError
from hybridpd.proto import kv_transfer_pb2 as pb
from hybridpd.proto import kv_transfer_pb2_grpc as pb_grpc

TOKEN = "s3cret-token"


class FakeHandler:
    def __init__(self) -> None:
        self.leases = {"req-live": 1000.0}
        self.released: list[tuple[str, bool]] = []
        self.secrets_seen: list[str] = []

    def metadata(self) -> pb.NodeMetadata:
        return pb.NodeMetadata(
            engine_id="prefill-0", model_name="tiny", compat_hash="abc", compat_fields={"dtype": "float32"},
            transport_name="prefill-0", transport_metadata=b"\x00nixl\xff", transport_address="127.0.0.1",
            groups=[pb.GroupRegion(kind="full_attention", page_size_bytes=4096, num_blocks=64, base_addr=1 << 40,
                                   block_size=16)],
        )

    def heartbeat(self, request_id: str, secret: str, trace=None) -> LeaseView | None:
        self.secrets_seen.append(secret)
        if request_id not in self.leases:
            return None
        self.leases[request_id] += 60.0
        return LeaseView(expiry=self.leases[request_id], block_ids=((3, 4, 5), (), (7,)), num_tokens=40)

    def release(self, request_id: str, aborted: bool, secret: str) -> bool:
        self.secrets_seen.append(secret)
        self.released.append((request_id, aborted))
        return self.leases.pop(request_id, None) is not None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(params=[None, TOKEN], ids=["no-token", "token"])
async def server(request) -> AsyncIterator[tuple[SideChannelServer, FakeHandler, str | None]]:
    handler = FakeHandler()
    srv = SideChannelServer(handler, "127.0.0.1", 0, request.param)
    await srv.start()
    try:
        yield srv, handler, request.param
    finally:
        await srv.stop(0)


async def test_metadata_heartbeat_release_round_trip(server) -> None:
    srv, handler, token = server
    client = SideChannelClient("127.0.0.1", srv.port, token, timeout_s=5)
    try:
        meta = await client.get_metadata("decode-0")
        assert meta == handler.metadata()
        assert await client.heartbeat("req-live", "s1") == LeaseView(
            expiry=1060.0, block_ids=((3, 4, 5), (), (7,)), num_tokens=40)
        assert (await client.heartbeat("req-live", "s1")).expiry == 1120.0  # the channel is reused
        with pytest.raises(KVTransferError, match="lease lost: no live lease for request req-gone") as info:
            await client.heartbeat("req-gone", "s2")
        assert info.value.peer == f"127.0.0.1:{srv.port}"
        assert await client.release("req-live", aborted=False, secret="s1") is True
        assert await client.release("req-live", aborted=True, secret="s1") is False
        assert handler.released == [("req-live", False), ("req-live", True)]
        assert handler.secrets_seen == ["s1", "s1", "s2", "s1", "s1"]  # the lease secret travels with every call
    finally:
        await client.close()


@pytest.mark.parametrize("client_token", [None, "wrong", TOKEN + "x", ""])
async def test_a_missing_or_wrong_token_is_unauthenticated(client_token: str | None) -> None:
    handler = FakeHandler()
    srv = SideChannelServer(handler, "127.0.0.1", 0, TOKEN)
    await srv.start()
    client = SideChannelClient("127.0.0.1", srv.port, client_token, timeout_s=5)
    try:
        for call in (client.get_metadata(), client.heartbeat("req-live", "s"), client.release("req-live", False, "s")):
            with pytest.raises(KVTransferError, match="rejected the cluster token") as info:
                await call
            assert TOKEN not in str(info.value)
        assert handler.leases == {"req-live": 1000.0} and handler.released == []
    finally:
        await client.close()
        await srv.stop(0)


async def test_health_service_needs_no_token(server) -> None:
    srv, _, _ = server
    async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "hybridpd.kv_transfer.KVTransfer"):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_unreachable_port_raises_naming_the_peer() -> None:
    port = free_port()  # nothing listens there
    client = SideChannelClient("127.0.0.1", port, None, timeout_s=2)
    try:
        with pytest.raises(KVTransferError, match="unreachable") as info:
            await asyncio.wait_for(client.get_metadata(), timeout=30)
        assert info.value.peer == f"127.0.0.1:{port}" and f"127.0.0.1:{port}" in str(info.value)
    finally:
        await client.close()


async def test_a_peer_that_never_answers_times_out() -> None:
    with socket.socket() as silent:  # accepts TCP connections (backlog) but never speaks HTTP/2
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        client = SideChannelClient("127.0.0.1", port, None, timeout_s=0.5)
        try:
            with pytest.raises(KVTransferError) as info:
                await asyncio.wait_for(client.heartbeat("r", "s"), timeout=30)
            assert info.value.peer == f"127.0.0.1:{port}"
            assert "did not answer within 0.5s" in info.value.reason  # a deadline, not a refused connection
        finally:
            await client.close()


async def test_release_without_status_is_invalid(server) -> None:
    srv, handler, token = server
    async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await pb_grpc.KVTransferStub(channel).Release(
                pb.ReleaseRequest(request_id="req-live"), timeout=5, metadata=bearer_metadata(token)
            )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert handler.released == []


def test_the_client_repr_never_shows_the_token() -> None:
    assert TOKEN not in repr(SideChannelClient("127.0.0.1", 1, TOKEN, timeout_s=1))


@pytest.mark.parametrize("peer, host", [
    ("ipv4:127.0.0.1:5555", "127.0.0.1"), ("ipv6:[::1]:5555", "::1"), ("ipv6:%5B::1%5D:5555", "::1"),
    ("ipv4:10.77.0.2:41000", "10.77.0.2"),
])
def test_peer_host(peer, host):
    from hybridpd.connector.side_channel_server import peer_host

    assert peer_host(peer) == host


@pytest.mark.parametrize("trusted, allowed", [(["127.0.0.0/8"], True), (["10.77.0.0/24"], False)])
async def test_metadata_goes_only_to_trusted_peers(trusted, allowed) -> None:
    """The transport metadata lets its holder READ all registered KV memory: GetMetadata needs the token AND a
    trusted peer address; heartbeats and releases (which need a lease secret) are not affected."""
    from hybridpd.connector.trusted_peers import TrustedPeers

    handler = FakeHandler()
    srv = SideChannelServer(handler, "127.0.0.1", 0, TOKEN, TrustedPeers.parse(trusted))
    await srv.start()
    client = SideChannelClient("127.0.0.1", srv.port, TOKEN, timeout_s=5)
    try:
        if allowed:
            assert await client.get_metadata("decode-0") == handler.metadata()
        else:
            with pytest.raises(KVTransferError, match="PERMISSION_DENIED: 127.0.0.1 is not a trusted peer"):
                await client.get_metadata("decode-0")
        assert (await client.heartbeat("req-live", "s")).num_tokens == 40
    finally:
        await client.close()
        await srv.stop(0)
