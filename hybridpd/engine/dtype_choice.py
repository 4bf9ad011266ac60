"""`--dtype auto` (the default), as vLLM's CPU backend chooses: the checkpoint's dtype where the CPU computes in it,
float32 elsewhere. bfloat16 is chosen only for a bfloat16 checkpoint on a CPU with bfloat16 units (AMX or
AVX512-BF16: `amx_bf16` / `avx512_bf16` in its flags); a float16 checkpoint is computed in float32 (its weights are
upcast), as is everything on a CPU without those units, where bfloat16 arithmetic is emulated and slower.
"""

from __future__ import annotations

from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16")
BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpuinfo_field(cpuinfo: str, *names: str) -> str | None:
    """The first processor's value of the first field called one of `names` in /proc/cpuinfo's text (None: none)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in names:
            return value.strip()
    return None


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The flags of the first processor in /proc/cpuinfo's text (empty when it has none: another OS)."""
    return frozenset((cpuinfo_field(cpuinfo, "flags", "Features") or "").split())


def _this_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def this_cpus_flags() -> frozenset[str]:
    return cpu_flags(_this_cpuinfo())


def this_cpus_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (what every benchmark report names its machine by)."""
    return cpuinfo_field(_this_cpuinfo(), "model name") or "unknown"


def this_cpus_vendor() -> str:
    """The CPU's maker as /proc/cpuinfo gives it (`GenuineIntel`, `AuthenticAMD`), empty where it says none."""
    return cpuinfo_field(_this_cpuinfo(), "vendor_id") or ""


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
