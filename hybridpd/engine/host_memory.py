"""How a serving process asks glibc to keep the memory it frees.

A step allocates the same large temporaries again and again (a prefill's [tokens, 580] projections, a decode
step's gathered K/V). With glibc's defaults, an allocation over the mmap threshold (128 KiB, raised dynamically)
is a fresh mmap that page-faults on first touch, and free heap above the trim threshold goes back to the
kernel, to be faulted in again next step: on this project's benchmark that was a third of a prefill step and a
fifth of a decode step. Raising both thresholds keeps freed memory in the process for reuse (what tcmalloc or
jemalloc, which vLLM recommends on CPU, do by design). The cost: the process keeps its peak heap.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping

# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

TRIM_THRESHOLD_BYTES = 1 << 30  # free heap kept before any is returned to the kernel
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest allowed value: allocations below it come from the heap


# Environment variables through which glibc's malloc is configured at process start; when one is set, the
# allocator was configured on purpose (e.g. the soak test's fixed mmap threshold, so that RSS tracks live memory).
ALLOCATOR_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def allocator_configured(environ: Mapping[str, str]) -> bool:
    return any(name in environ for name in ALLOCATOR_VARIABLES)


def keep_freed_memory() -> bool:
    """Raise glibc's trim and mmap thresholds for this whole process. False where `mallopt` is not available
    (another C library), which leaves the allocator as it was."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
