"""The prefill role's answers on the side channel (the `SideChannelHandler` the gRPC server calls)."""

from __future__ import annotations

from hybridpd.connector.lease_view import LeaseView
from hybridpd.prefill_node.role import PrefillRole
from hybridpd.proto import kv_transfer_pb2 as pb


class PrefillSideChannel:
    def __init__(self, role: PrefillRole, metadata: pb.NodeMetadata) -> None:
        self._role = role
        self._metadata = metadata

    def metadata(self) -> pb.NodeMetadata:
        return self._metadata

    def heartbeat(self, request_id: str, secret: str) -> LeaseView:
        """Renews the lease; raises LookupError saying why not (expired, released, never held, not the holder)."""
        lease = self._role.heartbeat(request_id, secret)
        return LeaseView(expiry=self._role.leases.unix_time(lease.expiry), block_ids=lease.block_ids, num_tokens=lease.num_tokens,
                         prompt_digest=lease.prompt_digest, seconds_left=lease.expiry - self._role.leases.clock())

    def release(self, request_id: str, aborted: bool, secret: str) -> bool:
        return self._role.release(request_id, aborted, secret)
