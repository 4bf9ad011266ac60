"""The CPUs the engine thread runs on (`--engine-cpus`), as a Linux CPU list: "0", "0-3", "0,2,4-5".

vLLM's CPU build pins its compute threads the same way (`VLLM_CPU_OMP_THREADS_BIND`). On a small host a pinned engine
thread keeps its core's caches while the event loop, the side channel and clients run on the others.
"""

from __future__ import annotations

import os


def parse_cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a Linux CPU list; ValueError naming the flag for anything else, or CPUs this process may not use."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()) or (high and int(high) < int(low)):
            raise ValueError(f"--engine-cpus must be a CPU list such as 0, 0-3 or 0,2,4-5; got {text!r}")
        cpus.update(range(int(low), int(high or low) + 1))
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ValueError(f"--engine-cpus {text}: CPUs {sorted(cpus - allowed)} are not available to this process "
                         f"(it may run on {sorted(allowed)})")
    return frozenset(cpus)


def pin_current_thread(cpus: frozenset[int]) -> None:
    """Run the calling thread (and the threads it starts from now on) only on `cpus`."""
    os.sched_setaffinity(0, cpus)
