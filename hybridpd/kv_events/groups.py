"""A KV cache group as a KV event consumer sees it; light enough for the node's HTTP front (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridpd.engine.kv_cache.spec import KVCacheGroup


@dataclass(frozen=True, kw_only=True)
class GroupInfo:
    """What a consumer needs to know of a group (vLLM's `kv_cache_spec_kind` / `_sliding_window`)."""

    group_idx: int
    kind: str
    block_size: int
    sliding_window: int | None

    @classmethod
    def of(cls, group_idx: int, group: KVCacheGroup) -> GroupInfo:
        from hybridpd.engine.kv_cache.spec import SlidingWindowSpec  # the engine's side only (it imports torch)

        spec = group.spec
        window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
        return cls(group_idx=group_idx, kind=spec.kind, block_size=spec.block_size, sliding_window=window)

    def as_json(self) -> dict:
        return {"group_idx": self.group_idx, "kind": self.kind, "block_size": self.block_size,
                "sliding_window": self.sliding_window}
