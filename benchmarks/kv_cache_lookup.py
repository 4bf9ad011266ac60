"""Speed of the hybrid KV cache's admission path: hit search, allocation, free.

Four groups (full attention, full attention with other KV heads, a sliding window, Mamba align), a
2,048-token prompt of which the first 1,024 tokens are cached. Prints medians in microseconds; the last line is
a JSON object with `us_per_lookup` (get_computed_blocks on a new request, hashing included),
`us_per_lookup_hashed` (the same with the request's hashes already computed), `us_per_allocate` and `us_per_free`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import torch

from hybridpd.config import CacheConfig
from hybridpd.engine.kv_cache.coordinator import KVCacheManager
from hybridpd.engine.kv_cache.spec import FullAttentionSpec, KVCacheGroup, MambaSpec, SlidingWindowSpec

PROMPT_TOKENS = 2048
CACHED_TOKENS = 1024


@dataclass
class BenchRequest:
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    cache_salt: bytes | None = None
    skip_mamba_align: bool = False


def build_manager(block_size: int, interval: int, window: int) -> KVCacheManager:
    f32 = torch.float32
    specs = (
        FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=64, dtype=f32),
        FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=f32),
        SlidingWindowSpec(block_size=block_size, num_kv_heads=8, head_size=64, dtype=f32, sliding_window=window),
        MambaSpec(block_size=interval, conv_state_shape=(3, 256), ssm_state_shape=(8, 32, 16), dtypes=(f32, f32)),
    )
    groups = tuple(KVCacheGroup(spec=s, layer_ids=(i,)) for i, s in enumerate(specs))
    attention_blocks = 4 * PROMPT_TOKENS // block_size
    return KVCacheManager(groups, (attention_blocks, attention_blocks, attention_blocks, 64),
                          CacheConfig(block_size=block_size))


def median_us(samples: list[int]) -> float:
    return round(statistics.median(samples) / 1000, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--interval", type=int, default=256)
    parser.add_argument("--window", type=int, default=512)
    args = parser.parse_args()

    m = build_manager(args.block_size, args.interval, args.window)
    shared = [(i * 7919) % 32000 for i in range(CACHED_TOKENS)]
    seed = BenchRequest("seed", shared + [1] * (PROMPT_TOKENS - CACHED_TOKENS), PROMPT_TOKENS)
    m.allocate_slots(seed, PROMPT_TOKENS)
    m.commit(seed, PROMPT_TOKENS)
    m.free("seed")

    lookup, lookup_hashed, allocate, free = [], [], [], []
    hit_tokens = 0
    for rep in range(args.reps):
        req = BenchRequest(f"r{rep}", shared + [2 + rep] * (PROMPT_TOKENS - CACHED_TOKENS), PROMPT_TOKENS)
        t0 = time.perf_counter_ns()
        hit = m.get_computed_blocks(req)
        t1 = time.perf_counter_ns()
        m.get_computed_blocks(req)
        t2 = time.perf_counter_ns()
        step = m.allocate_slots(req, PROMPT_TOKENS - hit.num_tokens, hit)
        t3 = time.perf_counter_ns()
        m.free(req.request_id)
        t4 = time.perf_counter_ns()
        if step is None:
            raise SystemExit("benchmark pool too small")
        hit_tokens = hit.num_tokens
        lookup.append(t1 - t0)
        lookup_hashed.append(t2 - t1)
        allocate.append(t3 - t2)
        free.append(t4 - t3)
    m.check_invariants()

    result = {
        "groups": ["full_attention", "full_attention", "sliding_window", "mamba"],
        "prompt_tokens": PROMPT_TOKENS,
        "cached_tokens": CACHED_TOKENS,
        "hit_tokens": hit_tokens,
        "block_size": args.block_size,
        "mamba_interval": args.interval,
        "sliding_window": args.window,
        "reps": args.reps,
        "us_per_lookup": median_us(lookup),
        "us_per_lookup_hashed": median_us(lookup_hashed),
        "us_per_allocate": median_us(allocate),
        "us_per_free": median_us(free),
    }
    print(f"hit {hit_tokens}/{PROMPT_TOKENS} tokens; lookup {result['us_per_lookup']} us "
          f"(hashes known: {result['us_per_lookup_hashed']} us), allocate {result['us_per_allocate']} us, "
          f"free {result['us_per_free']} us")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
