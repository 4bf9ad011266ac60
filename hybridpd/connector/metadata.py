"""The `NodeMetadata` a node publishes on its side channel: identity, compatibility and registered regions."""

from __future__ import annotations

from collections.abc import Sequence

from hybridpd.connector.transport import Transport
from hybridpd.engine.kv_cache.spec import KVCacheGroup
from hybridpd.proto import kv_transfer_pb2 as pb


def node_metadata(*, engine_id: str, model_name: str, fields: dict[str, str], compat_hash: str,
                  transport: Transport, groups: Sequence[KVCacheGroup], transport_address: str) -> pb.NodeMetadata:
    layouts = transport.local_layouts()
    return pb.NodeMetadata(
        engine_id=engine_id,
        model_name=model_name,
        compat_hash=compat_hash,
        compat_fields=fields,
        transport_name=transport.name,
        transport_metadata=transport.local_metadata(),
        transport_address=transport_address,
        groups=[
            pb.GroupRegion(kind=group.spec.kind, page_size_bytes=layout.page_size_bytes, num_blocks=layout.num_blocks,
                           base_addr=layout.base_addr, block_size=group.spec.block_size)
            for group, layout in zip(groups, layouts, strict=True)
        ],
    )
