"""How close the engine runs to this machine's bounds, on the `granite-350m` preset, per dtype, in one run.

The machine, measured here: memory bandwidth (a copy of 1 GiB: bytes read + written over its time) and matmul peak
(the model's own projection shapes, 2,048 rows, FLOPs over time), each per dtype: the best of torch's product
(MKL), oneDNN's through a packed weight where the build packs the dtype (the engine's path on some CPUs: on the EPYC
with AVX-512 MKL's float32 products ran at half of oneDNN's, and the engine's prefill at 1.7x "the peak" MKL alone
gave), and for bfloat16 the product widened to float32 (what a CPU without bfloat16 units must do, and does faster:
on the AVX2 guest torch's emulated bfloat16 runs at a tenth of float32's rate). The engine, measured in
the same run through `LLMEngine` (one thread, the serving defaults): a decode step at batch 1, 8 and 32 (prompts of
256 tokens; the median of the steps after the prefill) and one 2,048-token prefill step.

The machine is measured before the engine and again after it, and the better of the two figures bounds the engine
(`machine_before_after` holds both): on a guest whose speed drifts within a run, a slow moment of the machine's
own measurement would otherwise flatter the engine.

Bounds: a decode step must read every weight once plus each sequence's attention KV and Mamba state (read and
written back), so `decode_roofline_fraction` = (those bytes / bandwidth) / measured step time; a prefill step does
2 FLOPs per weight per token in its projections, so `prefill_roofline_fraction` = (FLOPs / matmul peak) / measured
time (attention's own FLOPs are left out of the bound, which makes the fraction a slight underestimate). Goals: decode
at batch 1 >= 0.6 of the bandwidth bound, prefill >= 0.5 of the matmul peak, both dtypes. Last line: JSON with
`decode_roofline_fraction` (batch 1) and `prefill_roofline_fraction` for the default dtype (`--dtype auto` on this
CPU), every figure beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hybridpd.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridpd.engine.dtype_choice import choose_dtype, this_cpus_flags
from hybridpd.engine.engine import LLMEngine
from hybridpd.engine.host_memory import keep_freed_memory
from hybridpd.engine.kv_cache.spec import MambaSpec, SlidingWindowSpec
from hybridpd.engine.model.config_fields import checkpoint_dtype
from hybridpd.engine.model.kernels.packed import packed_linear, packing_works
from hybridpd.presets.checkpoints import write_checkpoint
from hybridpd.engine.request import EngineRequest
from hybridpd.engine.sampling_params import SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def bandwidth_gbps(dtype: torch.dtype, nbytes: int = 2**30, repeats: int = 5) -> float:
    source = torch.ones(nbytes // torch.finfo(dtype).bits * 8, dtype=dtype)
    target = torch.empty_like(source)
    target.copy_(source)
    best = min(_timed(lambda: target.copy_(source)) for _ in range(repeats))
    return 2 * nbytes / best / 1e9


def matmul_gflops(dtype: torch.dtype, shapes: list[tuple[int, int]], rows: int = 2048, repeats: int = 3) -> float:
    """FLOP/s of `rows x in @ in x out` over the model's projection shapes, the best of `repeats` passes of each way
    a product can run here: torch's `F.linear` (MKL), oneDNN through a packed weight where this build packs the
    dtype (packed.py), and for bfloat16 the product widened to float32."""
    weights = [torch.randn(out, inp).to(dtype) for inp, out in shapes]
    inputs = {inp: torch.randn(rows, inp).to(dtype) for inp, _ in shapes}
    flops = sum(2 * rows * inp * out for inp, out in shapes)
    ways = {"torch": lambda x, w: torch.nn.functional.linear(x, w)}
    if packing_works(dtype):
        ways["packed"] = packed_linear
    if dtype == torch.bfloat16:
        ways["widened"] = lambda x, w: torch.nn.functional.linear(x.float(), w.float()).to(dtype)

    def run(product) -> None:
        for (inp, _), weight in zip(shapes, weights):
            product(inputs[inp], weight)

    best = float("inf")
    for product in ways.values():
        run(product)
        best = min(best, *(_timed(lambda: run(product)) for _ in range(repeats)))
    return flops / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def engine_for(model_dir: Path, dtype: str, max_num_seqs: int, max_tokens: int) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model_dir=model_dir, dtype=dtype, threads=1,
        cache=CacheConfig(kv_cache_memory=4 * 2**30),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                                  max_model_len=4096),
    ))


def decode_step_s(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> float:
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    generator = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = tuple(torch.randint(3, 500, (prompt_len,), generator=generator).tolist())
        engine.add_request(EngineRequest(request_id=f"d{batch}-{i}", prompt_token_ids=prompt, sampling=params))
    times = []
    while engine.has_work():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        if outputs and all(len(o.new_token_ids) == 1 for o in outputs) and len(outputs) == batch:
            times.append(elapsed)
    return statistics.median(times[1:] or times)


def prefill_s(engine: LLMEngine, length: int, seed: int = 7) -> float:
    """Seconds to prefill one prompt of `length` random token ids (`seed`: another seed, another prompt)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = tuple(torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist())
    engine.add_request(EngineRequest(request_id="p", prompt_token_ids=prompt, sampling=params))
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    return time.perf_counter() - start


def model_bytes(engine: LLMEngine) -> tuple[int, int, list[tuple[int, int]]]:
    """(bytes of every weight, weights in projections, the projections' (in, out) shapes)."""
    weights = projection = 0
    shapes: list[tuple[int, int]] = []
    for name, parameter in engine.model.named_parameters():
        weights += parameter.numel() * parameter.element_size()
        if parameter.dim() == 2 and "embed" not in name and "lm_head" not in name:
            projection += parameter.numel()
            shapes.append((parameter.shape[1], parameter.shape[0]))
    return weights, projection, sorted(set(shapes))


def per_sequence_bytes(engine: LLMEngine, context: int) -> int:
    """Attention KV read at `context` tokens plus every Mamba state read and written, for one sequence."""
    total = 0
    for group in engine.groups:
        if isinstance(group.spec, MambaSpec):
            total += 2 * group.page_size_bytes
            continue
        tokens = min(context, group.spec.sliding_window) if isinstance(group.spec, SlidingWindowSpec) else context
        total += tokens * group.page_size_bytes // group.spec.block_size
    return total


def measure(model_dir: Path, dtype: str, batches: list[int], prompt_len: int, prefill_len: int,
            steps: int) -> dict:
    engine = engine_for(model_dir, dtype, max(batches), max(prefill_len, max(batches) * prompt_len))
    weights, projection, shapes = model_bytes(engine)
    torch_dtype = DTYPES[dtype]
    # The machine is measured before and after the engine and the better of the two taken as its bound: a guest
    # whose speed drifts within a run would otherwise bound the engine by a slow moment of its own.
    bandwidths, peaks = [bandwidth_gbps(torch_dtype)], [matmul_gflops(torch_dtype, shapes)]
    decode = {batch: decode_step_s(engine, batch, prompt_len, steps) for batch in batches}
    seconds = prefill_s(engine, prefill_len)
    bandwidths.append(bandwidth_gbps(torch_dtype))
    peaks.append(matmul_gflops(torch_dtype, shapes))
    bandwidth, peak = max(bandwidths), max(peaks)
    out = {"bandwidth_gbps": round(bandwidth, 2), "matmul_peak_gflops": round(peak, 1),
           "machine_before_after": {"bandwidth_gbps": [round(b, 2) for b in bandwidths],
                                    "matmul_peak_gflops": [round(p, 1) for p in peaks]},
           "weight_bytes": weights, "decode": {}}
    for batch, step in decode.items():
        bound = (weights + batch * per_sequence_bytes(engine, prompt_len + steps // 2)) / (bandwidth * 1e9)
        out["decode"][str(batch)] = {"step_ms": round(step * 1000, 2), "bound_ms": round(bound * 1000, 2),
                                     "roofline_fraction": round(bound / step, 3)}
    flops = 2 * projection * prefill_len
    out["prefill"] = {"tokens": prefill_len, "seconds": round(seconds, 3), "gflops": round(flops / seconds / 1e9, 1),
                      "roofline_fraction": round(flops / (peak * 1e9) / seconds, 3)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--preset", default="granite-350m")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8, help="decode steps measured per batch")
    args = parser.parse_args()
    keep_freed_memory()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(args.preset, Path(tmp) / args.preset)
        default, why = choose_dtype("auto", checkpoint_dtype(model_dir), this_cpus_flags())
        results = {}
        for dtype in args.dtypes:
            print(f"measuring {dtype} ...", flush=True)
            results[dtype] = measure(model_dir, dtype, args.batches, args.prompt_len, args.prefill_len, args.steps)
            print(json.dumps({dtype: results[dtype]}), flush=True)
    main_dtype = default if default in results else args.dtypes[0]
    print(json.dumps({
        "preset": args.preset, "dtype": main_dtype, "default_dtype": default, "why": why,
        "decode_roofline_fraction": results[main_dtype]["decode"][str(args.batches[0])]["roofline_fraction"],
        "prefill_roofline_fraction": results[main_dtype]["prefill"]["roofline_fraction"],
        "by_dtype": results,
    }))


if __name__ == "__main__":
    main()
