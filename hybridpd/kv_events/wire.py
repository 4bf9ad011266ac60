"""vLLM's KV event format (vllm/distributed/kv_events.py, vLLM 0.32): msgpack, written with msgspec.

A batch is an array `[ts, events, data_parallel_rank]`; each event is a map tagged `"type": "BlockStored" |
"BlockRemoved" | "AllBlocksCleared"`, default-valued fields omitted. Block hashes are bytes (vLLM's default;
ours are 32-byte chained BLAKE2b hashes, see engine/kv_cache/hashing.py). `medium` is "GPU" for the memory pool, the
name vLLM gives its primary KV tier on every platform (its CPU build too), so that consumers that filter on it keep
working, and "DISK" for the storage tier (--kv-offload-dir), whose BlockStored events carry no token ids.
On ZMQ a message is three frames: topic, 8-byte big-endian sequence number, payload.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from hybridpd.engine.kv_cache import events as engine_events
from hybridpd.kv_events.groups import GroupInfo

MEDIUM_STORAGE = engine_events.Medium.STORAGE.value
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(event: engine_events.KVCacheEvent, groups: Sequence[GroupInfo]) -> KVCacheEvent:
    if isinstance(event, engine_events.BlockStored):
        info = groups[event.group_idx]
        return BlockStored(
            block_hashes=list(event.block_hashes), parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids), block_size=event.block_size, lora_id=None, medium=event.medium.value,
            lora_name=None, group_idx=event.group_idx, kv_cache_spec_kind=info.kind,
            kv_cache_spec_sliding_window=info.sliding_window,
        )
    if isinstance(event, engine_events.BlockRemoved):
        return BlockRemoved(block_hashes=list(event.block_hashes), medium=event.medium.value, group_idx=event.group_idx)
    return AllBlocksCleared()


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(events: Iterable[engine_events.KVCacheEvent], groups: Sequence[GroupInfo],
                 ts: float | None = None) -> bytes:
    batch = KVEventBatch(ts=time.time() if ts is None else ts, events=[to_wire(e, groups) for e in events],
                         data_parallel_rank=0)
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises msgspec.DecodeError (a ValueError) on a payload that is not a KV event batch."""
    return _DECODER.decode(payload)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"a sequence frame has 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
