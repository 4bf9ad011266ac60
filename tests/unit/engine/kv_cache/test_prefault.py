"""The KV pool's memory faulted in ahead: which blocks the pools name (`upcoming` is what the next allocations
take), and that their pages become resident (asked of the kernel with mincore), come back after a release, and that
an engine step asks for them."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from hybridpd.engine.kv_cache.block_pool import BlockPool
from hybridpd.engine.kv_cache.budget import PageBudget
from hybridpd.engine.kv_cache.prefault import REGION_BYTES
from hybridpd.engine.kv_cache.spec import KVCacheGroup, MambaSpec
from hybridpd.engine.kv_cache.storage import KVCacheStorage

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)

# 20 KiB pages: whole memory pages inside each block
SPEC = MambaSpec(block_size=8, conv_state_shape=(4, 256), ssm_state_shape=(4, 1024),
                 dtypes=(torch.float32, torch.float32))
BLOCKS = 4 * REGION_BYTES // SPEC.page_size_bytes   # four regions


def resident(storage: KVCacheStorage, block: int) -> bool:
    """Whether every whole memory page of the block is in memory."""
    page = SPEC.page_size_bytes
    base = storage.tensors[0].data_ptr()
    start = -(-(base + block * page) // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (base + (block + 1) * page) // mmap.PAGESIZE * mmap.PAGESIZE
    pages = (end - start) // mmap.PAGESIZE
    vector = (ctypes.c_ubyte * pages)()
    assert _libc.mincore(start, end - start, vector) == 0, ctypes.get_errno()
    return all(v & 1 for v in vector)


@pytest.fixture
def storage():
    storage = KVCacheStorage((KVCacheGroup(spec=SPEC, layer_ids=(0,)),), (BLOCKS,))
    yield storage
    storage.close()


def region_of(storage: KVCacheStorage, block: int) -> int:
    return (storage.tensors[0].data_ptr() + block * SPEC.page_size_bytes) // REGION_BYTES


@pytest.mark.parametrize("shared", [False, True])
def test_upcoming_names_what_the_next_allocations_take(shared):
    budget = PageBudget(100) if shared else None
    pool = BlockPool(12, budget=budget, page_bytes=10 if shared else 0)
    first = pool.upcoming(3)
    assert pool.allocate(3) == first == [1, 2, 3]
    pool.free([2])
    # a shared pool's freed block was written: it names only ids it has not grown into; else the free queue's front
    assert pool.upcoming(2) == ([4, 5] if shared else [2, 4])
    assert pool.allocate(2) == [2, 4]


def test_a_shared_pool_names_a_block_given_back_first():
    budget = PageBudget(30)
    pool = BlockPool(12, budget=budget, page_bytes=10)
    pool.allocate(3)
    pool.free([2])
    assert pool.give_back(uncached_only=True)
    assert pool.upcoming(2) == [2, 4]   # its pages were released: writing it faults again


def test_the_regions_of_the_blocks_named_and_the_next_become_resident(storage):
    if not storage.prefaulter.supported:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    far = BLOCKS - 1
    assert region_of(storage, far) > region_of(storage, 1) + 1
    assert not resident(storage, 1) and not resident(storage, far)
    storage.prefault_ahead(([1, 2],))
    storage.prefaulter.wait_idle()
    if not storage.prefaulter.supported:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    in_next_region = next(b for b in range(BLOCKS) if region_of(storage, b) == region_of(storage, 1) + 1)
    assert resident(storage, 1) and resident(storage, 2) and resident(storage, in_next_region)
    assert not resident(storage, far)
    assert (storage.tensors[0][1] == 0).all()   # faulted in, never written


def test_a_released_block_is_populated_again_when_named_again(storage):
    storage.prefault_ahead(([1],))
    storage.prefaulter.wait_idle()
    if not storage.prefaulter.supported:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    storage.tensors[0][1].fill_(7)
    storage.release(0, 1)
    assert not resident(storage, 1)
    asked = storage.prefaulter.populated_bytes
    storage.prefault_ahead(([1],))
    storage.prefaulter.wait_idle()
    assert resident(storage, 1) and storage.prefaulter.populated_bytes > asked
    assert (storage.tensors[0][1] == 0).all()


def test_a_region_is_asked_for_once(storage):
    storage.prefault_ahead(([1, 2],))
    storage.prefaulter.wait_idle()
    asked = storage.prefaulter.populated_bytes
    # other blocks of the regions asked for (where the pool's mapping begins decides which blocks share a region)
    same_region = [b for b in range(BLOCKS) if region_of(storage, b) == region_of(storage, 2)]
    assert same_region != [1, 2]
    storage.prefault_ahead((same_region,))
    storage.prefaulter.wait_idle()
    assert storage.prefaulter.populated_bytes == asked
