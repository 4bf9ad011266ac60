import pytest

from hybridpd.config import CacheConfig, MambaCacheMode
from hybridpd.engine.kv_cache.coordinator import KVCacheManager
from hybridpd.engine.kv_cache.memory import attention_token_limit, blocks_for_count, blocks_for_memory
from hybridpd.engine.kv_cache.spec import MambaSpec

from .builders import fa, groups_of, mamba, sw


@pytest.mark.parametrize("specs, blocks, config, message", [
    ((fa(4),), (1,), CacheConfig(block_size=4), "at least 2"),
    ((fa(4), mamba(8)), (10,), CacheConfig(block_size=4), "2 KV cache groups but 1 block counts"),
    ((fa(16), mamba(24)), (10, 10), CacheConfig(block_size=16), "multiple of every attention block size"),
    ((fa(4), sw(8, 16), mamba(32)), (10, 10, 10), CacheConfig(block_size=4), None),
    ((fa(4), sw(8, 16), mamba(8)), (10, 10, 10), CacheConfig(block_size=4), "not of \\[16\\]"),
    ((fa(4), mamba(8)), (10, 10), CacheConfig(block_size=4, mamba_cache_interval=16), "--mamba-cache-interval"),
    ((fa(16), mamba(24)), (10, 10), CacheConfig(block_size=16, mamba_cache_mode=MambaCacheMode.NONE), None),
    ((), (), CacheConfig(), "at least one group"),
])
def test_bad_configuration_is_refused(specs, blocks, config, message):
    if message is None:
        KVCacheManager(groups_of(*specs), blocks, config)
    else:
        with pytest.raises(ValueError, match=message):
            KVCacheManager(groups_of(*specs), blocks, config)


@pytest.mark.parametrize("build", [
    lambda: sw(0, 4),
    lambda: fa(0),
    lambda: mamba(0),
])
def test_bad_specs_are_refused(build):
    with pytest.raises(ValueError):
        build()


SPECS = [(fa(4),), (fa(4), fa(4, heads=8), sw(16, 4), mamba(8)), (mamba(8),), (sw(8, 2), mamba(16))]


@pytest.mark.parametrize("specs", SPECS)
@pytest.mark.parametrize("memory", [1 << 16, 1 << 20, 1 << 24])
def test_memory_split_fits_and_gives_every_group_two_blocks(specs, memory):
    groups = groups_of(*specs)
    counts = blocks_for_memory(groups, memory, max_num_seqs=4)
    assert all(n >= 2 for n in counts)
    assert sum(n * g.page_size_bytes for n, g in zip(counts, groups)) <= memory
    KVCacheManager(groups, counts, CacheConfig(block_size=2))


def test_memory_split_gives_mamba_running_slots_and_equal_tokens_to_attention():
    groups = groups_of(fa(4), fa(8, heads=4), mamba(16))
    counts = blocks_for_memory(groups, 1 << 24, max_num_seqs=8)
    assert counts[2] >= 1 + 8
    assert abs((counts[0] - 1) * 4 - (counts[1] - 1) * 8) <= 8


@pytest.mark.parametrize("specs", SPECS)
def test_too_little_memory_says_how_much_one_block_per_group_needs(specs):
    groups = groups_of(*specs)
    need = sum(g.page_size_bytes for g in groups)
    with pytest.raises(ValueError, match=f"needs {need} B"):
        blocks_for_memory(groups, 2 * need - 1, max_num_seqs=4)


@pytest.mark.parametrize("specs, num_blocks, expected", [
    ((fa(4),), 10, (10,)),
    # 10 attention blocks of 256 B, a Mamba slot of 224 B: cached states are 10% of the cache, 2560 / 9 // 224 = 1
    ((fa(4), mamba(8)), 11, (11, 1 + 4 + 1)),
    ((fa(4), mamba(8)), 101, (101, 1 + 4 + 12)),      # 25600 / 9 // 224 = 12
    ((mamba(8),), 6, (1 + 4 + 5,)),
])
def test_explicit_block_count(specs, num_blocks, expected):
    assert blocks_for_count(groups_of(*specs), num_blocks, max_num_seqs=4) == expected


def test_explicit_block_count_must_leave_a_usable_block():
    with pytest.raises(ValueError, match="null block"):
        blocks_for_count(groups_of(fa(4)), 1, max_num_seqs=4)


@pytest.mark.parametrize("specs", SPECS)
@pytest.mark.parametrize("memory", [1 << 20, 1 << 24])
@pytest.mark.parametrize("budget", [0.0, 0.1, 0.5])
def test_attention_gets_what_the_mamba_budget_leaves(specs, memory, budget):
    groups = groups_of(*specs)
    counts = blocks_for_memory(groups, memory, max_num_seqs=4, mamba_budget=budget)
    assert sum(n * g.page_size_bytes for n, g in zip(counts, groups)) <= memory
    attention = [(n - 1) * g.spec.block_size for n, g in zip(counts, groups) if not isinstance(g.spec, MambaSpec)]
    mamba_counts = {n for n, g in zip(counts, groups) if isinstance(g.spec, MambaSpec)}
    assert len(mamba_counts) <= 1 and all(n >= 1 + 4 for n in mamba_counts)   # running slots first
    if attention:
        limit = attention_token_limit(groups, memory, max_num_seqs=4)
        assert min(attention) >= (1 - budget) * limit - max(g.spec.block_size for g in groups)
        assert max(attention) <= limit


@pytest.mark.parametrize("budget", [-0.1, 1.0, 2.0])
def test_a_budget_outside_0_1_is_refused(budget):
    with pytest.raises(ValueError, match="--mamba-cache-budget"):
        CacheConfig(mamba_cache_budget=budget)
