"""The start-up capacity report, as vLLM logs it: what each group holds and how many full-length requests fit."""

from __future__ import annotations

from dataclasses import dataclass

from hybridpd.engine.kv_cache.memory import SharedMemory, request_attention_bytes
from hybridpd.engine.kv_cache.spec import FullAttentionSpec, KVCacheGroup, MambaSpec, SlidingWindowSpec


@dataclass(frozen=True)
class KVCapacity:
    """The summary of a capacity report: the tokens the full attention holds, how many requests of the max length fit
    side by side, and the KV memory's bytes."""

    size_tokens: int
    max_concurrency: int
    memory_bytes: int

    @property
    def size_text(self) -> str:
        return f"{self.size_tokens:,} tokens" if self.size_tokens else "no full-attention tokens"


def capacity_report(groups: tuple[KVCacheGroup, ...], num_blocks: tuple[int, ...], max_model_len: int,
                    max_num_seqs: int, shared: SharedMemory | None = None) -> tuple[list[str], KVCapacity]:
    """One line per group, then the summary: KV cache size in tokens, and the maximum concurrency for requests of
    `max_model_len` tokens (full attention limits it; a window needs only its window's blocks per request)."""
    if shared is not None:
        return _shared_report(groups, num_blocks, max_model_len, max_num_seqs, shared)
    lines, limits = [], []
    total_bytes = sum(n * g.page_size_bytes for n, g in zip(num_blocks, groups))
    for gid, (group, n) in enumerate(zip(groups, num_blocks)):
        spec, usable = group.spec, n - 1
        name = f"KV cache group {gid} ({spec.kind}, {len(group.layer_ids)} layers)"
        if isinstance(spec, MambaSpec):
            cached = max(0, usable - max_num_seqs)
            lines.append(f"{name}: {usable} state slots ({min(usable, max_num_seqs)} for running requests, {cached} "
                         f"for cached prefixes, each at a multiple of {spec.block_size} tokens)")
            limits.append(usable)
            continue
        tokens = usable * spec.block_size
        lines.append(f"{name}: {usable} blocks of {spec.block_size} tokens = {tokens:,} tokens")
        if isinstance(spec, SlidingWindowSpec):
            per_request = -(-min(spec.sliding_window + spec.block_size, max_model_len) // spec.block_size)
            limits.append(usable // per_request)
        elif isinstance(spec, FullAttentionSpec):
            limits.append(usable // -(-max_model_len // spec.block_size))
    capacity = KVCapacity(_attention_tokens(groups, num_blocks), min(limits) if limits else 0, total_bytes)
    lines.append(f"KV cache size: {capacity.size_text} in {total_bytes / 2**20:.1f} MiB; maximum concurrency for "
                 f"{max_model_len:,} tokens per request: {capacity.max_concurrency}x")
    return lines, capacity


def _shared_report(groups: tuple[KVCacheGroup, ...], num_blocks: tuple[int, ...], max_model_len: int,
                   max_num_seqs: int, shared: SharedMemory) -> tuple[list[str], KVCapacity]:
    """Groups that share one budget: what each could hold alone, and how many requests fit side by side."""
    lines = []
    for gid, (group, n) in enumerate(zip(groups, num_blocks)):
        spec, page = group.spec, group.page_size_bytes
        name = f"KV cache group {gid} ({spec.kind}, {len(group.layer_ids)} layers)"
        if isinstance(spec, MambaSpec):
            lines.append(f"{name}: state slots of {page / 2**20:.1f} MiB taken from the shared memory as requests are "
                         f"admitted, up to {n - 1}; a state saved for the prefix cache (at a multiple of "
                         f"{spec.block_size} tokens) evicts other groups' blocks only while fewer than "
                         f"{shared.mamba_cached_cap} are cached")
        else:
            lines.append(f"{name}: blocks of {spec.block_size} tokens ({page / 2**10:.0f} KiB) from the shared "
                         f"memory, up to {n - 1} = {(n - 1) * spec.block_size:,} tokens")
    mamba = sum(g.page_size_bytes for g in groups if isinstance(g.spec, MambaSpec))
    per_request = request_attention_bytes(groups, max_model_len) + mamba
    capacity = KVCapacity(_attention_tokens(groups, num_blocks), shared.capacity // per_request, shared.capacity)
    lines.append(f"KV cache size: {capacity.size_text} in {shared.capacity / 2**20:.1f} MiB shared by every group (no "
                 f"running slot set aside; --max-num-seqs {max_num_seqs}); maximum concurrency for "
                 f"{max_model_len:,} tokens per request: {capacity.max_concurrency}x")
    return lines, capacity


def _attention_tokens(groups: tuple[KVCacheGroup, ...], num_blocks: tuple[int, ...]) -> int:
    """The tokens the smallest full-attention group holds (0 without one)."""
    return min(((n - 1) * g.spec.block_size for n, g in zip(num_blocks, groups)
                if isinstance(g.spec, FullAttentionSpec)), default=0)
