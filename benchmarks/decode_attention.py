"""Decode rows' attention through the compiled kernel against torch's SDPA, alone and inside an engine's steps.

Alone: one attention layer's decode rows over DecodeKV-shaped buffers ([rows, KV heads, capacity, head dim], rows of
lengths up to `--keys` apart by up to 200), the kernel (kernels/decode_attention.py, one thread) against SDPA with
the plan's mask at one and at two threads, for the preset's head shape, best of 5 passes. In an engine: one
`LLMEngine` (`--dtype`, one thread, the roofline script's settings) on `--preset`, decode steps at every `--batches`
size over prompts of `--prompt-len` tokens (the median of the steps after the prefill), with the kernel and with SDPA
over the same buffers, alternated round by round. Last line: JSON with `step_ratio` per batch (kernel over SDPA, the
median of the rounds; below 1 is faster), `call_ratio` per (rows, keys) against SDPA on one thread and
`call_ratio_two_threads` against SDPA on two, and every figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hybridpd.engine.dtype_choice import this_cpus_model
from hybridpd.engine.host_memory import keep_freed_memory
from hybridpd.engine.model.kernels.decode_attention import decode_attention
from hybridpd.engine.model.layers import attention as attention_module
from hybridpd.engine.model.step.masks import additive, visible
from hybridpd.presets.checkpoints import write_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import decode_step_s, engine_for  # noqa: E402  (the roofline script's engine and decode timing)


def best_us(fn, calls: int = 30, passes: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def call_figures(heads: int, kv_heads: int, head_dim: int, rows: int, keys: int, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(rows * keys)
    capacity = keys + 256
    k_buf, v_buf = (torch.randn(rows, kv_heads, capacity, head_dim, generator=gen).to(dtype) for _ in range(2))
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.tensor([keys - 1 - (37 * i) % 200 for i in range(rows)])
    length = int(positions.max()) + 1
    bias = additive(visible(positions, torch.arange(length), None), dtype)[:, None, None, :]
    q = qkv[:, : heads * head_dim].view(rows, kv_heads, heads // kv_heads, head_dim)
    scale = head_dim ** -0.5

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k_buf[:, :, :length], v_buf[:, :, :length], attn_mask=bias,
                                              scale=scale)

    first = torch.zeros_like(positions)
    kernel_us = best_us(lambda: decode_attention(qkv, k_buf, v_buf, first, positions + 1, heads, scale))
    sdpa_us = best_us(sdpa)
    torch.set_num_threads(2)
    try:
        sdpa_two_us = best_us(sdpa)
    finally:
        torch.set_num_threads(1)
    return {"kernel_us": round(kernel_us, 1), "sdpa_us": round(sdpa_us, 1),
            "sdpa_two_threads_us": round(sdpa_two_us, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--preset", default="small-vllm")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--keys", type=int, nargs="+", default=[300, 1024], help="the calls alone: longest row")
    parser.add_argument("--steps", type=int, default=12, help="decode steps measured per batch")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    keep_freed_memory()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(args.preset, Path(tmp) / args.preset)
        engine = engine_for(model_dir, args.dtype, max(args.batches), max(args.batches) * args.prompt_len + 64)
        layer = next(m for m in engine.model.modules() if isinstance(m, attention_module.Attention))
        heads, kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        calls = {f"{rows}x{keys}": call_figures(heads, kv_heads, head_dim, rows, keys, dtype)
                 for rows in args.batches for keys in args.keys}
        kernel_attends = attention_module._kernel_attends
        steps: dict[str, dict[int, list[float]]] = {"kernel": {}, "sdpa": {}}
        decode_step_s(engine, max(args.batches), 64, 2)   # warm up: compiled kernels, first-touch memory
        try:
            for r in range(args.rounds):
                for way in (("kernel", "sdpa") if r % 2 == 0 else ("sdpa", "kernel")):
                    attention_module._kernel_attends = kernel_attends if way == "kernel" else (lambda qkv: False)
                    for batch in args.batches:
                        engine.kv.reset_prefix_cache()
                        steps[way].setdefault(batch, []).append(
                            1000 * decode_step_s(engine, batch, args.prompt_len, args.steps))
                print(json.dumps({"round": r, **{w: {b: round(v[-1], 2) for b, v in s.items()}
                                                 for w, s in steps.items()}}), flush=True)
        finally:
            attention_module._kernel_attends = kernel_attends
    print(json.dumps({
        "preset": args.preset, "dtype": args.dtype, "prompt_len": args.prompt_len, "cpu": this_cpus_model(),
        "date": datetime.date.today().isoformat(), "heads": [heads, kv_heads, head_dim],
        "step_ratio": {b: round(statistics.median(k / s for k, s in zip(steps["kernel"][b], steps["sdpa"][b])), 3)
                       for b in args.batches},
        "call_ratio": {n: round(c["kernel_us"] / c["sdpa_us"], 3) for n, c in calls.items()},
        "call_ratio_two_threads": {n: round(c["kernel_us"] / c["sdpa_two_threads_us"], 3) for n, c in calls.items()},
        "step_ms": {w: {b: [round(v, 2) for v in s[b]] for b in args.batches} for w, s in steps.items()},
        "calls": calls,
    }))


if __name__ == "__main__":
    main()
