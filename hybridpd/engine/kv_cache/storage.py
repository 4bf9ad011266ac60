"""The canonical KV cache of a node: one contiguous block-major int8 tensor per group.

`tensors[g][block]` is one contiguous page holding that block for every layer of group g. Per-layer K/V and
conv/ssm views are reinterpretations of the same memory; the connector registers `tensors` as they are.
Memory comes from anonymous mappings, advised onto huge pages (which UCX reads fastest) and touched only when a block
is first written: groups that share one budget (budget.py) have more block ids than memory, and `release` returns a
block's pages to the operating system when its group gives the block's bytes to another group. `prefault_ahead`
has the pages of the blocks the pools will hand out next faulted in beforehand, off the engine's thread
(prefault.py).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from hybridpd.engine.kv_cache.prefault import REGION_BYTES, Prefaulter
from hybridpd.engine.kv_cache.spec import AttentionSpec, KVCacheGroup, MambaSpec


@dataclass(frozen=True)
class LayerSlot:
    group_id: int
    index_in_group: int


class KVCacheStorage:
    def __init__(self, groups: tuple[KVCacheGroup, ...], num_blocks: tuple[int, ...]) -> None:
        if len(groups) != len(num_blocks):
            raise ValueError(f"{len(groups)} groups but {len(num_blocks)} block counts")
        self.groups = groups
        self.num_blocks = num_blocks
        self._maps = tuple(_anonymous(n * g.page_size_bytes) for g, n in zip(groups, num_blocks))
        self.tensors: tuple[torch.Tensor, ...] = tuple(
            torch.frombuffer(m, dtype=torch.int8).view(n, g.page_size_bytes)
            for m, g, n in zip(self._maps, groups, num_blocks)
        )
        self._slots = {
            layer: LayerSlot(gid, i) for gid, g in enumerate(groups) for i, layer in enumerate(g.layer_ids)
        }
        # Views are built once per layer: `tensors` never changes identity, so a view can never go stale.
        self._attention_views: dict[int, torch.Tensor] = {}
        self._attention_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._mamba_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.prefaulter = Prefaulter()
        self._populated: tuple[set[int], ...] = tuple(set() for _ in groups)   # regions asked for, per group
        self._last_upcoming: list[list[int]] = [[] for _ in groups]   # what the last call named (most steps: the same)

    def slot(self, layer_id: int) -> LayerSlot:
        return self._slots[layer_id]

    def _layer_bytes(self, layer_id: int) -> torch.Tensor:
        s = self._slots[layer_id]
        page = self.groups[s.group_id].spec.page_size_bytes
        return self.tensors[s.group_id][:, s.index_in_group * page : (s.index_in_group + 1) * page]

    def attention_view(self, layer_id: int) -> torch.Tensor:
        """(num_blocks, 2, block_size, num_kv_heads, head_size) view of one attention layer (0 = K, 1 = V)."""
        view = self._attention_views.get(layer_id)
        if view is None:
            view = self._attention_views[layer_id] = self._build_attention_view(layer_id)
        return view

    def attention_rows(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one attention layer as (num_blocks, block_size * num_kv_heads * head_size) row views: a
        block's K (or V) is one contiguous row, so whole blocks are gathered with one `index_select`."""
        rows = self._attention_rows.get(layer_id)
        if rows is None:
            view = self.attention_view(layer_id)
            rows = self._attention_rows[layer_id] = (view[:, 0].flatten(1), view[:, 1].flatten(1))
        return rows

    def _build_attention_view(self, layer_id: int) -> torch.Tensor:
        spec = self.groups[self._slots[layer_id].group_id].spec
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"layer {layer_id} is not an attention layer")
        raw = self._layer_bytes(layer_id)
        n = raw.shape[0]
        used = math.prod(spec.kv_shape) * torch.empty((), dtype=spec.dtype).element_size()
        return raw[:, :used].view(spec.dtype).view(n, *spec.kv_shape)

    def mamba_views(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(num_blocks, *conv_state_shape) and (num_blocks, *ssm_state_shape) views of one Mamba layer."""
        views = self._mamba_views.get(layer_id)
        if views is None:
            views = self._mamba_views[layer_id] = self._build_mamba_views(layer_id)
        return views

    def _build_mamba_views(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.groups[self._slots[layer_id].group_id].spec
        if not isinstance(spec, MambaSpec):
            raise TypeError(f"layer {layer_id} is not a Mamba layer")
        raw = self._layer_bytes(layer_id)
        n = raw.shape[0]
        conv_dtype, ssm_dtype = spec.dtypes
        conv_used = math.prod(spec.conv_state_shape) * torch.empty((), dtype=conv_dtype).element_size()
        ssm_used = math.prod(spec.ssm_state_shape) * torch.empty((), dtype=ssm_dtype).element_size()
        conv = raw[:, :conv_used].view(conv_dtype).view(n, *spec.conv_state_shape)
        ssm = raw[:, spec.conv_bytes : spec.conv_bytes + ssm_used].view(ssm_dtype).view(n, *spec.ssm_state_shape)
        return conv, ssm

    def copy_block(self, group_id: int, src: int, dst: int) -> None:
        self.tensors[group_id][dst].copy_(self.tensors[group_id][src])

    def release(self, group_id: int, block: int) -> None:
        """Return the memory pages that lie wholly inside the block to the operating system (they read as zeros when
        the block is used again)."""
        page = self.groups[group_id].page_size_bytes
        start = -(-block * page // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (block + 1) * page // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self._maps[group_id].madvise(mmap.MADV_DONTNEED, start, end - start)
            base = self.tensors[group_id].data_ptr()
            self._populated[group_id].difference_update(
                range((base + start) // REGION_BYTES, (base + end - 1) // REGION_BYTES + 1))
            self._last_upcoming[group_id] = []

    def prefault_ahead(self, upcoming: tuple[list[int], ...]) -> None:
        """Have the memory of each group's next blocks (`upcoming[g]`, as the pools will hand them out) faulted in
        by the prefaulter: the regions they lie in and the region after the last, each asked for once (again after
        a release in it)."""
        for group_id, blocks in enumerate(upcoming):
            if not blocks or blocks == self._last_upcoming[group_id]:
                continue
            self._last_upcoming[group_id] = blocks
            page = self.groups[group_id].page_size_bytes
            base = self.tensors[group_id].data_ptr()
            end = base + self.num_blocks[group_id] * page
            regions = {(base + b * page) // REGION_BYTES for b in blocks}
            regions.add(max(regions) + 1)
            populated = self._populated[group_id]
            for region in sorted(regions - populated):
                start, stop = max(base, region * REGION_BYTES), min(end, (region + 1) * REGION_BYTES)
                start -= start % mmap.PAGESIZE
                if stop > start:
                    self.prefaulter.populate(start, stop - start)
                populated.add(region)

    def close(self) -> None:
        """Stop the prefaulter's thread."""
        self.prefaulter.close()


def _anonymous(size: int) -> mmap.mmap:
    """`size` bytes of zeros that take memory only where they are written."""
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    return region
