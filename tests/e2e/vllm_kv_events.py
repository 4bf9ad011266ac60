"""A KV event consumer that knows only vLLM's format (vllm/distributed/kv_events.py of vLLM 0.32), as an external
router would: vLLM's struct definitions restated here, a SUB socket, and the replay protocol. Nothing of
hybridpd's own wire module is used, so a drift of ours from vLLM's format fails here."""

from __future__ import annotations

from typing import Any

import msgspec
import zmq

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
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
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


class VLLMSubscriber:
    """SUB to a publisher's endpoint; `receive` returns (seq, batch) decoded with vLLM's types."""

    def __init__(self, endpoint: str, topic: str = "") -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._sub.connect(endpoint)

    def receive(self, timeout_ms: int = 10_000) -> tuple[str, int, KVEventBatch] | None:
        if not self._sub.poll(timeout_ms):
            return None
        topic, seq, payload = self._sub.recv_multipart()
        return topic.decode(), int.from_bytes(seq, "big"), DECODER.decode(payload)

    def close(self) -> None:
        self._sub.close(linger=0)
        self._ctx.term()


def replay(endpoint: str, start_seq: int, timeout_ms: int = 10_000) -> list[tuple[int, KVEventBatch]]:
    """vLLM's replay client: DEALER sends (b"", seq); frames (b"", seq, payload) until seq == -1."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
        sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
        out = []
        while True:
            if not sock.poll(timeout_ms):
                raise TimeoutError(f"no replay answer from {endpoint}")
            _, seq_frame, payload = sock.recv_multipart()
            seq = int.from_bytes(seq_frame, "big", signed=True)
            if seq == -1:
                return out
            out.append((seq, DECODER.decode(payload)))
    finally:
        sock.close(linger=0)
        ctx.term()
