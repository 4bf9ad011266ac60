"""`--dtype auto`: the checkpoint's dtype where the CPU has bfloat16 units, float32 elsewhere; explicit choices kept."""

from __future__ import annotations

import pytest

from hybridpd.engine.dtype_choice import choose_dtype, cpu_flags

AMX = frozenset({"avx2", "amx_bf16", "avx512_bf16"})
AVX512_BF16 = frozenset({"avx2", "avx512f", "avx512_bf16"})
AVX2 = frozenset({"avx2", "fma"})


@pytest.mark.parametrize("requested, checkpoint, flags, expected", [
    ("auto", "bfloat16", AMX, "bfloat16"),
    ("auto", "bfloat16", AVX512_BF16, "bfloat16"),
    ("auto", "bfloat16", AVX2, "float32"),        # emulated bfloat16 is slower than float32
    ("auto", "float32", AMX, "float32"),
    ("auto", "float16", AMX, "float32"),          # no float16 compute: its weights are upcast
    ("float32", "bfloat16", AMX, "float32"),
    ("bfloat16", "float32", AVX2, "bfloat16"),    # asked for explicitly
])
def test_auto_follows_the_checkpoint_where_the_cpu_computes_in_it(requested, checkpoint, flags, expected):
    dtype, why = choose_dtype(requested, checkpoint, flags)
    assert dtype == expected and why.startswith(f"--dtype {requested}")


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="--dtype"):
        choose_dtype("float8", "float32", AVX2)


def test_flags_are_read_from_cpuinfo_text():
    text = "processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    assert cpu_flags(text) == frozenset({"fpu", "avx2", "amx_bf16"})
    assert cpu_flags("") == frozenset()
