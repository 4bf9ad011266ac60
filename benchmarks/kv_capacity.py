"""KV capacity per GiB and the prefix hit rate under memory pressure: the every-interval cache policy (`--mamba-cache-retention every`) against the
bounded, demand-driven one (engine/kv_cache/memory.py, retention.py).

Policies:
- `every_interval` (`--mamba-cache-retention every`): a Mamba group gets one cached-state slot per interval of the attention tokens, and a
  request saves a state at every interval boundary it crosses;
- `budgeted_sparse` (now): running Mamba slots first, cached states under `--mamba-cache-budget` (default 10% of
  what is left), attention gets the rest; a request saves its prompt's end, the boundary of the prefix it shared,
  and a few boundaries while generating.

Capacity: per preset (shapes only: models are built on the meta device, no weights), the attention tokens each
policy gives 1 GiB, over the physical limit (the attention tokens 1 GiB holds with the running Mamba slots set
aside and no cached state): `attention_tokens_per_gib_ratio`, goal >= 0.9.

Hit rate: the default preset's real block sizes, a KVCacheManager driven like the engine drives it (admit, prefill
in one step, generate `--output` tokens, free), a prefix-repetition workload (`--prefixes` shared prefixes of
`--prefix-len` tokens, each asked `--repeats` times in shuffled order with a fresh suffix), the memory sized so
that the every-interval policy holds about a third of the prefixes; the hit rate is hit tokens over prompt tokens
(the hybrid hit, every group agreeing). Goal: the new policy's rate >= 0.9x the every-interval policy's.

Running requests: per preset at the default budget (512 MiB) and the preset's max model length, how many requests of
`--running-len` tokens (512 in, 64 out) are admitted side by side, the memory the only limit: the fixed split
(running Mamba slots for `--max-num-seqs` 32 or 1024 set aside at start-up, after one max-length request) against the
shared budget the engine uses (budget.py: a slot is paid for at admission; `ratio`: over the better fixed split).
The hit-rate workload also runs on the shared budget (`shared_sparse`: one LRU over every group's cached blocks).

Last line: JSON with per preset `attention_tokens_per_gib_ratio` (both policies), `hit_rate` (both policies and
their ratio, and the shared budget's) and `running_requests` (fixed, shared, ratio).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass

import torch

from hybridpd.config import CacheConfig, MambaCacheMode, MambaRetentionPolicy
from hybridpd.engine.kv_cache.coordinator import KVCacheManager
from hybridpd.engine.engine import DEFAULT_KV_CACHE_MEMORY
from hybridpd.engine.kv_cache.memory import KVLayout, attention_token_limit, blocks_for_memory, layout_for_memory
from hybridpd.engine.kv_cache.spec import KVCacheGroup, MambaSpec, group_layers
from hybridpd.presets.shapes import SHAPES
from hybridpd.engine.model.registry import family_for

GIB = 2**30
BLOCK = 16
PRESETS = ("small", "granite-moe", "nemotron-h", "granite-350m")
MAX_NUM_SEQS = 32


def _preset(preset: str):
    raw = SHAPES[preset] | {"vocab_size": 512, "eos_token_id": 0, "bos_token_id": 0}
    family = family_for(raw)
    return family, family.parse_config(raw)


def preset_max_len(preset: str) -> int:
    """The preset's max model length, as its parsed config (and so a node) has it."""
    return _preset(preset)[1].max_position_embeddings


def preset_groups(preset: str) -> tuple[KVCacheGroup, ...]:
    family, config = _preset(preset)
    with torch.device("meta"):
        model = family.build(config, torch.float32)
    interval = math.lcm(BLOCK, config.mamba_chunk_size)
    return group_layers(model.kv_cache_specs(BLOCK, interval))


def every_interval_blocks(groups: tuple[KVCacheGroup, ...], memory: int) -> tuple[int, ...]:
    """The every-interval rule: one cached Mamba slot per interval of the attention tokens."""
    pages = [g.page_size_bytes for g in groups]
    mamba = [isinstance(g.spec, MambaSpec) for g in groups]
    mamba_pages = sum(p for p, m in zip(pages, mamba) if m)
    attention_pages = sum(p for p, m in zip(pages, mamba) if not m)
    running = max(1, min(MAX_NUM_SEQS, (memory - mamba_pages - 2 * attention_pages) // mamba_pages)) \
        if mamba_pages else MAX_NUM_SEQS
    fixed = sum((1 + running if m else 1) * p for p, m in zip(pages, mamba))
    per_token = sum(p / g.spec.block_size for p, g in zip(pages, groups))
    tokens = int((memory - fixed) / per_token)
    return tuple(1 + running + tokens // g.spec.block_size if m else 1 + max(1, tokens // g.spec.block_size)
                 for g, m in zip(groups, mamba))


def attention_tokens(groups: tuple[KVCacheGroup, ...], counts: tuple[int, ...]) -> int:
    return min((n - 1) * g.spec.block_size for n, g in zip(counts, groups) if not isinstance(g.spec, MambaSpec))


@dataclass
class _Req:
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    cache_salt: bytes | None = None
    skip_mamba_align: bool = False


def hit_rate(groups, layout: KVLayout, retention: MambaRetentionPolicy, prompts: list[list[int]], output: int) -> float:
    kv = KVCacheManager(groups, layout.num_blocks, CacheConfig(block_size=BLOCK, mamba_retention=retention),
                        shared=layout.shared)
    hit_tokens = prompt_tokens = 0
    for i, prompt in enumerate(prompts):
        req = _Req(f"r{i}", list(prompt), len(prompt))
        hit = kv.get_computed_blocks(req)
        if kv.allocate_slots(req, len(prompt) - hit.num_tokens, hit) is None:
            raise RuntimeError("the workload does not fit one request: give more memory")
        kv.commit(req, len(prompt))
        hit_tokens += hit.num_tokens
        prompt_tokens += len(prompt)
        for _ in range(output):
            req.all_token_ids.append(7)
            if kv.allocate_slots(req, 1) is None:
                break
            kv.commit(req, len(req.all_token_ids))
        kv.free(req.request_id)
    return hit_tokens / prompt_tokens


def side_by_side(groups, layout: KVLayout, length: int, limit: int = 1024) -> int:
    """Requests of `length` tokens (no two alike, no prefix caching) admitted one after another until one fails."""
    kv = KVCacheManager(groups, layout.num_blocks, CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
                        shared=layout.shared)
    for n in range(limit):
        req = _Req(f"r{n}", [n] * length, length)
        if kv.allocate_slots(req, length, kv.get_computed_blocks(req)) is None:
            return n
    return limit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefixes", type=int, default=48)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--running-len", type=int, default=576)
    args = parser.parse_args()
    out: dict = {"presets": {}, "running_requests": {}}
    for preset in PRESETS:
        groups = preset_groups(preset)
        limit = attention_token_limit(groups, GIB, max_num_seqs=MAX_NUM_SEQS)
        old = attention_tokens(groups, every_interval_blocks(groups, GIB))
        new = attention_tokens(groups, blocks_for_memory(groups, GIB, max_num_seqs=MAX_NUM_SEQS))
        out["presets"][preset] = {
            "physical_limit_tokens": limit, "every_interval_tokens": old, "budgeted_sparse_tokens": new,
            "attention_tokens_per_gib_ratio": round(new / limit, 4),
            "every_interval_ratio": round(old / limit, 4),
        }
        print(f"{preset}: {out['presets'][preset]}", file=sys.stderr, flush=True)
        length = preset_max_len(preset)
        fixed = {seqs: side_by_side(groups, KVLayout(blocks_for_memory(
            groups, DEFAULT_KV_CACHE_MEMORY, max_num_seqs=seqs, mamba_cache_mode=MambaCacheMode.NONE,
            max_model_len=length)), args.running_len) for seqs in (32, 1024)}
        shared = side_by_side(groups, layout_for_memory(groups, DEFAULT_KV_CACHE_MEMORY, max_num_seqs=1024,
                                                        mamba_cache_mode=MambaCacheMode.NONE, max_model_len=length),
                              args.running_len)
        out["running_requests"][preset] = {"fixed_split_32": fixed[32], "fixed_split_1024": fixed[1024],
                                           "shared": shared, "ratio": round(shared / max(fixed.values()), 3)}
        print(f"{preset} running: {out['running_requests'][preset]}", file=sys.stderr, flush=True)

    groups = preset_groups("small")
    rng = random.Random(0)
    prefixes = [[rng.randrange(1, 500) for _ in range(args.prefix_len)] for _ in range(args.prefixes)]
    order = [p for p in prefixes for _ in range(args.repeats)]
    rng.shuffle(order)
    prompts = [p + [rng.randrange(1, 500) for _ in range(args.suffix_len)] for p in order]
    # memory: the every-interval policy holds about a third of the prefixes (with their Mamba states)
    per_request = args.prefix_len + args.suffix_len + args.output
    memory = 1 << 20
    while attention_tokens(groups, every_interval_blocks(groups, memory)) < args.prefixes * per_request / 3:
        memory = int(memory * 1.25)
    old_rate = hit_rate(groups, KVLayout(every_interval_blocks(groups, memory)), MambaRetentionPolicy.EVERY, prompts,
                        args.output)
    new_counts = blocks_for_memory(groups, memory, max_num_seqs=MAX_NUM_SEQS, mamba_cache_mode=MambaCacheMode.ALIGN)
    new_rate = hit_rate(groups, KVLayout(new_counts), MambaRetentionPolicy.SPARSE, prompts, args.output)
    shared_rate = hit_rate(groups, layout_for_memory(groups, memory, max_num_seqs=MAX_NUM_SEQS),
                           MambaRetentionPolicy.SPARSE, prompts, args.output)
    ceiling = (args.repeats - 1) / args.repeats * args.prefix_len / (args.prefix_len + args.suffix_len)
    out["hit_rate"] = {
        "memory_mib": round(memory / 2**20, 1), "every_interval": round(old_rate, 4),
        "budgeted_sparse": round(new_rate, 4), "ratio": round(new_rate / old_rate, 4) if old_rate else None,
        "shared_sparse": round(shared_rate, 4),
        "ceiling": round(ceiling, 4),
        "workload": {k: getattr(args, k) for k in ("prefixes", "prefix_len", "suffix_len", "repeats", "output")},
    }
    out["attention_tokens_per_gib_ratio"] = {p: v["attention_tokens_per_gib_ratio"] for p, v in out["presets"].items()}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
