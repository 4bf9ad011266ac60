"""A prefill's attention through oneDNN's products against torch's SDPA, alone and inside a served-like workload.

Alone: one attention layer of `--preset`'s head shape, `--dtype`, one thread: query rows after earlier keys, as
(rows, earlier keys) in `--calls`, through kernels/product_attention.py against SDPA as the layer calls it (a fresh
prompt through `attention_meta`'s query chunks, rows after earlier keys with their additive mask), best of 7; each
one's largest error against a float64 reference beside it. In a workload: one `LLMEngine` (the serving defaults, one
thread) on the preset runs `--num-prompts` random prompts of `--input-len` tokens with `--output-len` greedy tokens
each at `--concurrency` in flight (a finished request replaced at once, as `hybridpd bench --max-concurrency` does),
with the products and without them (every call to SDPA), alternated round by round. Last line: JSON with
`workload_ratio` (output tokens a second with the products over without, the median of the rounds; above 1 is
faster), `call_ratio` per call (products over SDPA; below 1 is faster), whether this CPU takes the products by
default (`products_pay`), the CPU, the date, and every figure.
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

from hybridpd.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridpd.engine.dtype_choice import this_cpus_model
from hybridpd.engine.engine import LLMEngine
from hybridpd.engine.host_memory import keep_freed_memory
from hybridpd.engine.model.kernels import product_attention
from hybridpd.engine.model.layers.attention import Attention
from hybridpd.engine.model.step.attention_meta import _query_chunks
from hybridpd.engine.request import EngineRequest
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.presets.checkpoints import write_checkpoint


def best_us(fn, passes: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, scale: float) -> torch.Tensor:
    """The layer's SDPA calls: q [n, Hq, D], k / v [first + n, Hkv, D] -> [n, Hq, D]."""
    n, m = q.shape[0], k.shape[0]
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    if first == 0:
        out = torch.empty(1, q.shape[1], n, q.shape[2], dtype=q.dtype)
        for c in _query_chunks(n, None, q.dtype):
            out[:, :, c.q_start : c.q_end] = F.scaled_dot_product_attention(
                qh[:, :, c.q_start : c.q_end], kh[:, :, c.k_start : c.q_end], vh[:, :, c.k_start : c.q_end],
                attn_mask=c.bias, is_causal=c.bias is None, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    seen = torch.arange(m)[None, :] <= first + torch.arange(n)[:, None]
    bias = torch.zeros(n, m, dtype=q.dtype).masked_fill_(~seen, float("-inf"))
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, scale=scale, enable_gqa=True)[0].transpose(0, 1)


def call_figures(heads: int, kv_heads: int, head_dim: int, rows: int, first: int, dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(rows + first)
    q = torch.randn(rows, heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(first + rows, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    scale = head_dim ** -0.5
    out = torch.empty_like(q)

    def products() -> torch.Tensor:
        product_attention.causal_attention(q, k, v, out, first, scale)
        return out

    want = sdpa(q.double(), k.double(), v.double(), first, scale)
    return {"products_us": round(best_us(products), 1),
            "sdpa_us": round(best_us(lambda: sdpa(q, k, v, first, scale)), 1),
            "products_error": float((products().double() - want).abs().max()),
            "sdpa_error": float((sdpa(q, k, v, first, scale).double() - want).abs().max())}


def workload_tok_s(engine: LLMEngine, args: argparse.Namespace, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    sent = 0

    def add() -> None:
        nonlocal sent
        prompt = tuple(torch.randint(3, 500, (args.input_len,), generator=gen).tolist())
        engine.add_request(EngineRequest(request_id=f"{seed}-{sent}", prompt_token_ids=prompt, sampling=params))
        sent += 1

    for _ in range(min(args.concurrency, args.num_prompts)):
        add()
    start, tokens = time.perf_counter(), 0
    while engine.has_work():
        outputs = engine.step()
        tokens += sum(len(o.new_token_ids) for o in outputs)
        for o in outputs:
            if o.finished and sent < args.num_prompts:
                add()
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--preset", default="small-vllm")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--calls", nargs="+", default=["1024x0", "512x0", "192x832", "64x960", "2048x0"],
                        help="ROWSxEARLIER: query rows after that many earlier keys")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6, help="workload rounds (0: the calls alone)")
    args = parser.parse_args()
    keep_freed_memory()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(args.preset, Path(tmp) / args.preset)
        engine = LLMEngine(EngineConfig(model_dir=model_dir, dtype=args.dtype, threads=1,
                                        cache=CacheConfig(kv_cache_memory=2**30), scheduler=SchedulerConfig()))
        layer = next(m for m in engine.model.modules() if isinstance(m, Attention))
        shape = (layer.num_heads, layer.num_kv_heads, layer.head_dim)
        calls = {c: call_figures(*shape, *map(int, c.split("x")), dtype) for c in args.calls}
        takes = product_attention.takes
        figures: dict[str, list[float]] = {"products": [], "sdpa": []}
        if args.rounds:   # warm up: compiled kernels, first-touch memory
            workload_tok_s(engine, argparse.Namespace(**{**vars(args), "num_prompts": args.concurrency}), seed=99)
        try:
            for r in range(args.rounds):
                for way in (("products", "sdpa") if r % 2 == 0 else ("sdpa", "products")):
                    product_attention.takes = takes if way == "products" else (lambda *a: False)
                    engine.kv.reset_prefix_cache()
                    figures[way].append(workload_tok_s(engine, args, seed=r))
                print(json.dumps({"round": r, **{w: round(f[-1], 1) for w, f in figures.items()}}), flush=True)
        finally:
            product_attention.takes = takes
    print(json.dumps({
        "preset": args.preset, "dtype": args.dtype, "cpu": this_cpus_model(), "date": datetime.date.today().isoformat(),
        "products_pay": product_attention.products_pay(dtype), "heads": list(shape),
        "workload": f"{args.input_len}/{args.output_len} c{args.concurrency}, {args.num_prompts} prompts",
        "workload_ratio": round(statistics.median(p / s for p, s in zip(figures["products"], figures["sdpa"])), 3)
        if args.rounds else None,
        "call_ratio": {c: round(f["products_us"] / f["sdpa_us"], 3) for c, f in calls.items()},
        "tok_s": {w: [round(x, 1) for x in f] for w, f in figures.items()},
        "calls": calls,
    }))


if __name__ == "__main__":
    main()
