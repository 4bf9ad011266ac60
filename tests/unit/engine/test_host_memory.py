"""keep_freed_memory: glibc's thresholds raised, so a freed large buffer is reused without new page faults."""

import ctypes.util
import resource

import pytest
import torch

from hybridpd.engine.host_memory import allocator_configured, keep_freed_memory


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(ctypes.util.find_library("c") is None, reason="no C library to tune")
def test_a_freed_large_buffer_is_reused_without_page_faults():
    assert keep_freed_memory()
    size = 8 << 20  # 8 MiB: above glibc's default mmap threshold, below the raised one
    pages = size // resource.getpagesize()
    for _ in range(2):
        torch.ones(size // 4).sum()  # allocate, touch, free
    before = minor_faults()
    for _ in range(5):
        torch.ones(size // 4).sum()
    # With glibc's defaults every round trip faults the buffer in again (5 x ~2,000 faults here); kept memory
    # faults at most once more (when a small allocation took the freed space and the heap grows past it).
    assert minor_faults() - before < 2 * pages

@pytest.mark.parametrize("environ, configured", [
    ({}, False),
    ({"PATH": "/bin"}, False),
    ({"MALLOC_MMAP_THRESHOLD_": "131072"}, True),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, True),
])
def test_an_allocator_configured_in_the_environment_is_left_alone(environ, configured):
    assert allocator_configured(environ) is configured
