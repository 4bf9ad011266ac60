"""The routed experts' three paths, one layer alone and in an engine, side by side in one process, rounds alternated.

The paths (layers/moe.py), each with its routing: the compiled kernel (kernels/fused_moe.py, the rows routed in the
same pass, up to `rows_worth_fusing` rows), the grouped dispatch (the router, then a dozen torch operations per
expert) and every expert at once (`every_expert`: the router, then two products over all the experts, the
unchosen weighted 0); a layer takes it for bfloat16 steps of EVERY_EXPERT_MIN_ROWS rows and more on
a CPU with AMX, when its experts stay in cache).
1. One MoE layer of `--preset`'s shape (random weights), in `--dtype`, one thread: each path at each `--rows` count
   (the compiled kernel only where a layer would send it), the median of `--calls` calls, rounds alternated.
2. An engine on the preset's checkpoint (the roofline script's settings, `--dtype`, one thread): `--requests` requests
   of `--prompt-len` random tokens and `--output-len` greedy tokens at concurrency `--concurrency`, run to the end,
   with every expert at once allowed (from EVERY_EXPERT_MIN_ROWS rows on the layers whose experts stay in cache, as
   a CPU with AMX takes it, whatever this CPU is) and not, alternated round by round on the same engine (an engine
   made second runs a few percent apart from one made first, which one engine avoids).
Last line: JSON with `engine_ratio` (output tokens per second, allowed over not, the median of the rounds' ratios;
above 1 is faster), the layer's milliseconds per path and row count, the CPU, the date and every figure.
With `--layer H I E K` (hidden, intermediate, experts, top-k) only a layer of that shape, no engine: the compiled
kernel at every row count (where `rows_worth_fusing` should cut), every expert at once only where the experts stay in
cache, and `compiled_over_grouped` per row count (below 1: the compiled kernel is faster).
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

from hybridpd.engine.dtype_choice import this_cpus_model
from hybridpd.engine.host_memory import keep_freed_memory
from hybridpd.engine.model.kernels.fused_moe import routed_moe_rows
from hybridpd.engine.model.layers.moe import EVERY_EXPERT_MIN_ROWS, GraniteMoE, every_expert, grouped_experts
from hybridpd.engine.request import EngineRequest
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.presets.checkpoints import write_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import engine_for  # noqa: E402  (the roofline script's engine)


def layer_paths(layer: GraniteMoE, rows: int, dtype: torch.dtype, generator: torch.Generator,
                every_row_count: bool = False) -> dict:
    """The paths a layer may take for `rows` rows, each a call on the same inputs, its routing included (with
    `every_row_count` the compiled kernel at any row count, every expert at once only on a resident layer)."""
    x = torch.randn(rows, layer.input_linear.weight.shape[2], generator=generator).to(dtype)
    w_in, w_out = layer.input_linear.weight, layer.output_linear.weight
    paths = {"grouped": lambda: grouped_experts(x, *layer.router.forward(x), layer._expert, layer.num_experts)}
    if layer.resident or not every_row_count:
        paths["every_expert"] = lambda: every_expert(x, *layer.router.forward(x), w_in, layer._w_out_side_by_side())
    if rows <= layer.fused_max_rows or every_row_count:
        paths["compiled"] = lambda: routed_moe_rows(x, layer.router.layer.weight, layer.router.top_k, w_in, w_out)
    return paths


def median_call_s(call, calls: int) -> float:
    call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def output_rate(engine, args: argparse.Namespace, generator: torch.Generator, tag: str) -> float:
    """Output tokens per second of `--requests` requests at `--concurrency`, run to the end."""
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    added = tokens = 0
    start = time.perf_counter()
    while added < args.requests or engine.has_work():
        while added < args.requests and len(engine.request_ids()) < args.concurrency:
            prompt = tuple(torch.randint(3, 500, (args.prompt_len,), generator=generator).tolist())
            engine.add_request(EngineRequest(request_id=f"{tag}-{added}", prompt_token_ids=prompt, sampling=params))
            added += 1
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    return tokens / (time.perf_counter() - start)


def layer_only(args: argparse.Namespace) -> None:
    """`--layer`: one layer of the given shape, random weights, each path at each row count, rounds alternated."""
    hidden, inter, experts, top_k = args.layer
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    layer = GraniteMoE(hidden, inter, experts, top_k, dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_((torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5).to(dtype))
    layer_ms: dict[str, dict[int, list[float]]] = {}
    with torch.inference_mode():
        for k in range(args.rounds):
            print(f"round {k + 1}/{args.rounds} ...", file=sys.stderr, flush=True)
            for rows in args.rows:
                paths = list(layer_paths(layer, rows, dtype, generator, every_row_count=True).items())
                for name, call in (paths if k % 2 == 0 else paths[::-1]):
                    layer_ms.setdefault(name, {}).setdefault(rows, []).append(1e3 * median_call_s(call, args.calls))
    ms = {name: {rows: statistics.median(v) for rows, v in by_rows.items()} for name, by_rows in layer_ms.items()}
    print(json.dumps({
        "layer": {"hidden": hidden, "intermediate": inter, "experts": experts, "top_k": top_k}, "dtype": args.dtype,
        "cpu": this_cpus_model(), "date": datetime.date.today().isoformat(),
        "expert_mib": round((layer.input_linear.weight.nbytes + layer.output_linear.weight.nbytes) / 2 ** 20, 1),
        "fused_max_rows": layer.fused_max_rows,
        "compiled_over_grouped": {rows: round(ms["compiled"][rows] / ms["grouped"][rows], 2) for rows in args.rows},
        "layer_ms": {name: {rows: round(v, 3) for rows, v in by_rows.items()} for name, by_rows in ms.items()},
        "workload": vars(args),
    }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--preset", default="granite-moe")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 24, 32, 48, 256, 1024, 2048])
    parser.add_argument("--calls", type=int, default=20, help="calls per path, row count and round")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--layer", type=int, nargs=4, metavar=("H", "I", "E", "K"), default=None,
                        help="only one layer of this shape (hidden, intermediate, experts, top-k), no engine")
    args = parser.parse_args()
    keep_freed_memory()
    torch.set_num_threads(1)
    if args.layer is not None:
        if min(args.layer) < 1 or args.layer[3] > args.layer[2]:
            parser.error(f"--layer {' '.join(map(str, args.layer))}: positive sizes and top-k <= experts")
        layer_only(args)
        return
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(args.preset, Path(tmp) / args.preset)
        engine = engine_for(model_dir, args.dtype, 256, 2048)
        moe_layers = [m for m in engine.model.modules() if isinstance(m, GraniteMoE)]
        if not moe_layers:
            parser.error(f"--preset {args.preset} has no MoE layers")
        allowed = [EVERY_EXPERT_MIN_ROWS if m.resident else None for m in moe_layers]
        layer = moe_layers[0]
        layer_ms: dict[str, dict[int, list[float]]] = {}
        rates: dict[bool, list[float]] = {True: [], False: []}
        output_rate(engine, argparse.Namespace(**{**vars(args), "requests": 2}), generator, "warm-up")
        for k in range(args.rounds):
            print(f"round {k + 1}/{args.rounds} ...", file=sys.stderr, flush=True)
            for rows in args.rows:
                paths = list(layer_paths(layer, rows, dtype, generator).items())
                for name, call in (paths if k % 2 == 0 else paths[::-1]):
                    layer_ms.setdefault(name, {}).setdefault(rows, []).append(1e3 * median_call_s(call, args.calls))
            for on in ((True, False) if k % 2 == 0 else (False, True)):
                for moe, rows in zip(moe_layers, allowed):
                    moe.every_expert_min_rows = rows if on else None
                rates[on].append(output_rate(engine, args, generator, f"r{k}-{on}"))
            print(json.dumps({"round": k, "tok_s": {"allowed": round(rates[True][-1], 1),
                                                    "not": round(rates[False][-1], 1)}}), file=sys.stderr, flush=True)
        engine.close()

    ratios = [on / off for on, off in zip(rates[True], rates[False])]
    print(json.dumps({
        "preset": args.preset, "dtype": args.dtype, "cpu": this_cpus_model(), "date": datetime.date.today().isoformat(),
        "every_expert_from_rows": sorted({r for r in allowed if r is not None}) or None,
        "engine_ratio": round(statistics.median(ratios), 3),
        "engine_ratio_per_round": [round(r, 3) for r in ratios],
        "engine_tok_s": {"allowed": [round(r, 1) for r in rates[True]], "not": [round(r, 1) for r in rates[False]]},
        "layer_ms": {name: {rows: round(statistics.median(v), 3) for rows, v in by_rows.items()}
                     for name, by_rows in layer_ms.items()},
        "workload": vars(args),
    }))


if __name__ == "__main__":
    main()
