"""One simulated node: the real `KVCacheManager` over a checkpoint's real groups (built on the meta device: no
weights, no KV tensors), driven through the calls the engine makes for each request, and the index the proxy would
hold of it, fed by its own KV events. Requests run one after another, each whole: what a node caches and evicts
follows the order requests reach it, which is what hit rates depend on."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from hybridpd.config import CacheConfig
from hybridpd.engine.kv_cache.coordinator import KVCacheManager
from hybridpd.engine.kv_cache.memory import blocks_for_memory
from hybridpd.engine.kv_cache.spec import KVCacheGroup, group_layers
from hybridpd.engine.model.loader import read_model_config
from hybridpd.kv_events.groups import GroupInfo
from hybridpd.kv_events.wire import to_wire
from hybridpd.proxy.block_holders import BlockHolders
from hybridpd.proxy.kv_index import NodeIndex


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

    @classmethod
    def of(cls, model_dir: Path, memory: int, block_size: int, max_num_seqs: int, max_model_len: int) -> NodeLayout:
        config, build = read_model_config(model_dir)
        with torch.device("meta"):
            model = build(torch.float32)
        interval = math.lcm(block_size, config.mamba_chunk_size) if config.has_mamba else block_size
        groups = group_layers(model.kv_cache_specs(block_size, interval))
        try:
            counts = blocks_for_memory(groups, memory, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
        except ValueError as exc:
            raise SimulationError(str(exc)) from exc
        return cls(groups, counts, CacheConfig(block_size=block_size, enable_kv_cache_events=True))


@dataclass
class SimNode:
    name: str
    layout: NodeLayout
    holders: BlockHolders | None = None    # shared by the indexes of one simulated proxy
    busy_until: float = 0.0
    kv: KVCacheManager = field(init=False)
    index: NodeIndex = field(init=False)

    def __post_init__(self) -> None:
        self.kv = KVCacheManager(self.layout.groups, self.layout.num_blocks, replace(self.layout.cache))
        self._infos = [GroupInfo.of(i, g) for i, g in enumerate(self.layout.groups)]
        self.index = NodeIndex(self._infos, self.holders)

    def _publish(self) -> None:
        self.index.apply([to_wire(event, self._infos) for event in self.kv.take_events()])

    def _allocate(self, req: SimRequest, *args, **kwargs) -> tuple:
        blocks = self.kv.allocate_slots(req, *args, **kwargs)
        if blocks is None:
            raise SimulationError(f"{req.num_prompt_tokens} tokens do not fit node {self.name}'s KV cache: give "
                                  "more --kv-cache-memory or a smaller --max-model-len")
        return blocks.load

    def _decode_steps(self, req: SimRequest, outputs: list[int]) -> None:
        """The first output is there (sampled from the prompt's logits); each later one is one decode step."""
        req.all_token_ids.append(outputs[0])
        for token in outputs[1:]:
            self._allocate(req, 1)
            self.kv.commit(req, len(req.all_token_ids))
            req.all_token_ids.append(token)

    def prefill(self, request_id: str, prompt: list[int]) -> int:
        """The prefill role (or a colocated node's prompt): the hit over every group; the rest computed and cached."""
        req = SimRequest(request_id, list(prompt), len(prompt))
        hit = self.kv.get_computed_blocks(req)
        self._allocate(req, len(prompt) - hit.num_tokens, hit)
        self.kv.commit(req, len(prompt))
        self.kv.free(request_id)
        self._publish()
        return hit.num_tokens

    def decode(self, request_id: str, prompt: list[int], outputs: list[int]) -> tuple[int, int]:
        """The decode role: the full-attention hit (Mamba alignment skipped), the rest pulled, then the outputs.
        Returns (hit tokens, bytes pulled)."""
        req = SimRequest(request_id, list(prompt), len(prompt), skip_mamba_align=True)
        hit = self.kv.get_computed_blocks(req)
        loads = self._allocate(req, 0, hit, num_external_tokens=len(prompt) - hit.num_tokens, remote=True)
        pulled = sum(len(group_loads) * g.page_size_bytes for group_loads, g in zip(loads, self.layout.groups))
        self.kv.commit(req, len(prompt))
        self._decode_steps(req, outputs)
        self.kv.free(request_id)
        self._publish()
        return hit.num_tokens, pulled

    def colocated(self, request_id: str, prompt: list[int], outputs: list[int]) -> int:
        req = SimRequest(request_id, list(prompt), len(prompt))
        hit = self.kv.get_computed_blocks(req)
        self._allocate(req, len(prompt) - hit.num_tokens, hit)
        self.kv.commit(req, len(prompt))
        self._decode_steps(req, outputs)
        self.kv.free(request_id)
        self._publish()
        return hit.num_tokens
