"""One simulated node: the real `KVCacheManager` over a checkpoint's real groups (built on the meta device: no
weights, no KV tensors), driven through the calls the engine makes for each request, and the index the proxy would
hold of it, fed by its own KV events. Requests run one after another, each whole: what a node caches and evicts
follows the order requests reach it, which is what hit rates depend on."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from hybridpd.config import CacheConfig, MambaRetentionPolicy
from hybridpd.engine.kv_cache.cache_types import StepBlocks
from hybridpd.engine.kv_cache.coordinator import KVCacheManager
from hybridpd.engine.kv_cache.memory import SharedMemory, layout_for_memory
from hybridpd.engine.kv_cache.spec import KVCacheGroup, group_layers
from hybridpd.engine.model.loader import read_model_config
from hybridpd.kv_events.groups import GroupInfo
from hybridpd.kv_events import wire
from hybridpd.kv_events.wire import to_wire
from hybridpd.proxy.block_holders import BlockHolders
from hybridpd.proxy.kv_index import NodeIndex
from hybridpd.replay.storage import SimStorage


class SimulationError(RuntimeError):
    """The simulated cluster cannot run the trace as configured (say which flag to change)."""


@dataclass
class SimRequest:
    """What the cache reads of a request (engine/kv_cache/cache_types.CacheRequest)."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    cache_salt: bytes | None = None
    skip_mamba_align: bool = False


@dataclass(frozen=True)
class NodeLayout:
    """A checkpoint's KV groups and the block counts `--kv-cache-memory` gives them, as a node would start."""

    groups: tuple[KVCacheGroup, ...]
    num_blocks: tuple[int, ...]
    cache: CacheConfig
    shared: SharedMemory | None = None

    @classmethod
    def of(cls, model_dir: Path, memory: int, block_size: int, max_num_seqs: int, max_model_len: int,
           retention: MambaRetentionPolicy = MambaRetentionPolicy.SPARSE) -> NodeLayout:
        config, build = read_model_config(model_dir)
        with torch.device("meta"):
            model = build(torch.float32)
        interval = math.lcm(block_size, config.mamba_chunk_size) if config.has_mamba else block_size
        groups = group_layers(model.kv_cache_specs(block_size, interval))
        try:
            layout = layout_for_memory(groups, memory, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
        except ValueError as exc:
            raise SimulationError(str(exc)) from exc
        return cls(groups, layout.num_blocks, CacheConfig(block_size=block_size, enable_kv_cache_events=True,
                                                          mamba_retention=retention), layout.shared)


@dataclass(frozen=True)
class Served:
    """What serving one request on a node took: prompt tokens found in memory and read from storage beyond them, and
    the bytes read from storage and pulled from a prefill node."""

    memory_tokens: int
    storage_tokens: int = 0
    read_bytes: int = 0
    pulled_bytes: int = 0

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens not computed here (what `usage.prompt_tokens_details.cached_tokens` reports)."""
        return self.memory_tokens + self.storage_tokens


@dataclass
class SimNode:
    name: str
    layout: NodeLayout
    holders: BlockHolders | None = None    # shared by the indexes of one simulated proxy
    storage: SimStorage | None = None      # the storage tier (one directory every node shares)
    busy_until: float = 0.0
    kv: KVCacheManager = field(init=False)
    index: NodeIndex = field(init=False)

    def __post_init__(self) -> None:
        self.kv = KVCacheManager(self.layout.groups, self.layout.num_blocks, replace(self.layout.cache),
                                 shared=self.layout.shared)
        self._infos = [GroupInfo.of(i, g) for i, g in enumerate(self.layout.groups)]
        self.index = NodeIndex(self._infos, self.holders)
        if self.storage is not None:
            self.kv.use_storage(self.storage)

    def _publish(self) -> None:
        self.index.apply([to_wire(event, self._infos) for event in self.kv.take_events()])

    def see_storage(self, changes: Sequence[tuple[bool, int, bytes]]) -> None:
        """The shared directory's changes (written: True, gone: False; group; hash), as this node's DISK KV events
        (one event per run of one group's same change, as the tier publishes them)."""
        events: list[wire.KVCacheEvent] = []
        for (held, group), run in itertools.groupby(changes, key=lambda c: (c[0], c[1])):
            hashes: list[bytes | int] = [h for _, _, h in run]
            if held:
                events.append(wire.BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                                               block_size=self._infos[group].block_size, lora_id=None,
                                               medium=wire.MEDIUM_STORAGE, lora_name=None, group_idx=group))
            else:
                events.append(wire.BlockRemoved(block_hashes=hashes, medium=wire.MEDIUM_STORAGE, group_idx=group))
        self.index.apply(events)

    def _done(self, request_id: str) -> None:
        """The request ends: its blocks go back, the blocks that became hits are written behind, events go out."""
        self.kv.free(request_id)
        if self.storage is not None:
            self.storage.write((g, h) for g, h, _ in self.kv.take_new_cached())
        self._publish()

    def _allocate(self, req: SimRequest, *args, **kwargs) -> StepBlocks:
        blocks = self.kv.allocate_slots(req, *args, **kwargs)
        if blocks is None:
            raise SimulationError(f"{req.num_prompt_tokens} tokens do not fit node {self.name}'s KV cache: give "
                                  "more --kv-cache-memory or a smaller --max-model-len")
        return blocks

    def _read(self, req: SimRequest, blocks: StepBlocks, num_tokens: int) -> tuple[int, set[tuple[int, int]]]:
        """Read from storage what a storage hit of `num_tokens` brings: (bytes, the (group, block id)s it filled)."""
        assert self.storage is not None
        sources = self.kv.storage_sources(req, blocks, num_tokens)
        return self.storage.read((g, h) for g, _, h in sources), {(g, block_id) for g, block_id, _ in sources}

    def _compute_prompt(self, req: SimRequest) -> Served:
        """A prompt computed here after its hit over every group (memory, then what storage holds beyond it)."""
        prompt_len = req.num_prompt_tokens
        hit = self.kv.get_computed_blocks(req)
        stored = self.kv.storage_hit(req, hit) if self.storage is not None else 0
        if not stored:
            self._allocate(req, prompt_len - hit.num_tokens, hit)
            self.kv.commit(req, prompt_len)
            return Served(hit.num_tokens)
        read, _ = self._read(req, self._allocate(req, 0, hit, num_external_tokens=stored - hit.num_tokens,
                                                 remote=True), stored)
        self.kv.commit(req, stored)
        self._allocate(req, prompt_len - stored)
        self.kv.commit(req, prompt_len)
        return Served(hit.num_tokens, stored - hit.num_tokens, read_bytes=read)

    def _decode_steps(self, req: SimRequest, outputs: list[int]) -> None:
        """The first output is there (sampled from the prompt's logits); each later one is one decode step."""
        req.all_token_ids.append(outputs[0])
        for token in outputs[1:]:
            self._allocate(req, 1)
            self.kv.commit(req, len(req.all_token_ids))
            req.all_token_ids.append(token)

    def prefill(self, request_id: str, prompt: list[int]) -> Served:
        """The prefill role: the hit over every group (memory, then storage); the rest computed and cached."""
        req = SimRequest(request_id, list(prompt), len(prompt))
        served = self._compute_prompt(req)
        self._done(request_id)
        return served

    def decode(self, request_id: str, prompt: list[int], outputs: list[int], remote_cached_tokens: int = 0) -> Served:
        """The decode role: the full-attention hit (Mamba alignment skipped); storage's full-attention blocks beyond
        it read first, up to what the prefill node found cached (`remote_cached_tokens`); the rest pulled; then the
        outputs."""
        req = SimRequest(request_id, list(prompt), len(prompt), skip_mamba_align=True)
        hit = self.kv.get_computed_blocks(req)
        stored = (self.kv.storage_hit(req, hit, at_most=remote_cached_tokens)
                  if self.storage is not None and remote_cached_tokens else 0)
        blocks = self._allocate(req, 0, hit, num_external_tokens=len(prompt) - hit.num_tokens, remote=True)
        read, taken = self._read(req, blocks, stored) if stored else (0, set())
        pulled = sum(g.page_size_bytes for group, (loads, g) in enumerate(zip(blocks.load, self.layout.groups))
                     for _, block_id in loads if (group, block_id) not in taken)
        self.kv.commit(req, len(prompt))
        self._decode_steps(req, outputs)
        self._done(request_id)
        return Served(hit.num_tokens, stored - hit.num_tokens if stored else 0, read_bytes=read, pulled_bytes=pulled)

    def colocated(self, request_id: str, prompt: list[int], outputs: list[int]) -> Served:
        req = SimRequest(request_id, list(prompt), len(prompt))
        served = self._compute_prompt(req)
        self._decode_steps(req, outputs)
        self._done(request_id)
        return served
