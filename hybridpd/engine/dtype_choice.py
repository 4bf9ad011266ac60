"""`--dtype auto` (the default), as vLLM's CPU backend chooses: the checkpoint's dtype where the CPU computes in it,
float32 elsewhere. bfloat16 is chosen only for a bfloat16 checkpoint on a CPU with bfloat16 units (AMX or
AVX512-BF16: `amx_bf16` / `avx512_bf16` in its flags); a float16 checkpoint is computed in float32 (its weights are
upcast), as is everything on a CPU without those units, where bfloat16 arithmetic is emulated and slower.
"""

from __future__ import annotations

from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16")
BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The flags of the first processor in /proc/cpuinfo's text (empty when it has none: another OS)."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def this_cpus_flags() -> frozenset[str]:
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def _cpuinfo_field(name: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return None


def this_cpus_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (what every benchmark report names its machine by)."""
    return _cpuinfo_field("model name") or "unknown"


def this_cpus_vendor() -> str:
    """The CPU's maker as /proc/cpuinfo gives it (`GenuineIntel`, `AuthenticAMD`), empty where it says none."""
    return _cpuinfo_field("vendor_id") or ""


def choose_dtype(requested: str, checkpoint_dtype: str, flags: frozenset[str]) -> tuple[str, str]:
    """(the dtype to compute in, why) for `--dtype requested`."""
    if requested not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {requested!r}")
    if requested != "auto":
        return requested, f"--dtype {requested}"
    units = sorted(flags & BF16_FLAGS)
    if checkpoint_dtype == "bfloat16" and units:
        return "bfloat16", f"--dtype auto: a bfloat16 checkpoint, the CPU has {' and '.join(units)}"
    if checkpoint_dtype == "bfloat16":
        return "float32", "--dtype auto: a bfloat16 checkpoint, but the CPU has no bfloat16 units"
    return "float32", f"--dtype auto: a {checkpoint_dtype} checkpoint"
