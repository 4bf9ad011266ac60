"""Which blocks of a prompt's first `num_tokens` tokens a decode node needs, per group: the one rule both sides use.

The decode node computes token `num_tokens` itself; its query sees keys j with `num_tokens - W < j`, so a
window group needs only the blocks from `max(0, num_tokens + 1 - W) // block_size` on; a full-attention group needs
every block; a Mamba group needs its one state slot.
"""

from __future__ import annotations

from hybridpd.engine.kv_cache.spec import AttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec


def needed_span(spec: KVCacheSpec, num_tokens: int) -> tuple[int, int]:
    """[start, end) of the logical blocks (Mamba: state slots) that carry the KV of tokens [0, num_tokens)."""
    if isinstance(spec, MambaSpec):
        return (0, 1) if num_tokens > 0 else (0, 0)
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"no span rule for {type(spec).__name__}")
    end = -(-num_tokens // spec.block_size)
    if isinstance(spec, SlidingWindowSpec):
        return min(max(0, num_tokens + 1 - spec.sliding_window) // spec.block_size, end), end
    return 0, end
