"""The node's KV cache as vLLM's `vllm:cache_config_info` states it: a gauge at 1 whose labels are the cache's
configuration, which the tools around vLLM read for the block size and the capacity (the Gateway API inference
extension's `--cache-info-metric` reads `block_size` and `num_gpu_blocks`).

vLLM labels every field of its CacheConfig; the ones with a meaning here keep vLLM's names and its way of writing
them: `block_size` (the attention groups' block size), `num_gpu_blocks` (the blocks of the smallest full-attention
group: the KV memory's tokens in blocks, on a CPU), `kv_cache_size_tokens`, `kv_cache_max_concurrency` (requests of the
max model length side by side), `kv_cache_memory_bytes`, `enable_prefix_caching`, `cache_dtype` (`auto`: the model's),
`mamba_cache_mode` and `mamba_block_size` (tokens between saved Mamba states), `kv_offloading_size` (the storage
tier's GiB, `None` without one) and `num_cpu_blocks` (`None`: no CPU swap space apart from the cache itself).
"""

from __future__ import annotations

from hybridpd.config import CacheConfig
from hybridpd.engine.kv_cache.capacity import KVCapacity


def cache_config_info(cache: CacheConfig, capacity: KVCapacity, mamba_block_size: int | None) -> tuple[
        tuple[str, str], ...]:
    """(label, value) pairs, by name (as Prometheus writes labels)."""
    return (
        ("block_size", str(cache.block_size)),
        ("cache_dtype", "auto"),
        ("enable_prefix_caching", str(cache.enable_prefix_caching)),
        ("kv_cache_max_concurrency", str(float(capacity.max_concurrency))),
        ("kv_cache_memory_bytes", str(capacity.memory_bytes)),
        ("kv_cache_size_tokens", str(capacity.size_tokens)),
        ("kv_offloading_size", str(cache.kv_offload_size / 2**30) if cache.kv_offload_dir is not None else "None"),
        ("mamba_block_size", str(mamba_block_size)),
        ("mamba_cache_mode", cache.mamba_cache_mode.value),
        ("num_cpu_blocks", "None"),
        ("num_gpu_blocks", str(capacity.size_tokens // cache.block_size)),
    )
