"""The prefill role's answers on the side channel (the `SideChannelHandler` the gRPC server calls)."""

from __future__ import annotations

from collections.abc import Mapping

from hybridpd.connector.lease_view import LeaseView
from hybridpd.prefill_node.role import PrefillRole
from hybridpd.proto import kv_transfer_pb2 as pb
from hybridpd.tracing import NoTracer, Tracer


class PrefillSideChannel:
    def __init__(self, role: PrefillRole, metadata: pb.NodeMetadata, tracer: Tracer | None = None) -> None:
        self._role = role
        self._metadata = metadata
        self._tracer = tracer or NoTracer()

    def metadata(self) -> pb.NodeMetadata:
        return self._metadata

    def heartbeat(self, request_id: str, secret: str, trace: Mapping[str, str] = {}) -> LeaseView:
        """Renews the lease; raises LookupError saying why not (expired, released, never held, not the holder)."""
        with self._tracer.span("heartbeat (prefill node)", trace, {"gen_ai.request.id": request_id}):
            lease = self._role.heartbeat(request_id, secret)
        return LeaseView(expiry=self._role.leases.unix_time(lease.expiry), block_ids=lease.block_ids,
                         num_tokens=lease.num_tokens, prompt_digest=lease.prompt_digest,
                         seconds_left=lease.expiry - self._role.leases.clock())

    def release(self, request_id: str, aborted: bool, secret: str) -> bool:
        return self._role.release(request_id, aborted, secret)
