"""A decode step's compiled kernels on and off, on a preset, side by side in one process, rounds alternated.

The kernels: the few-rows projections (kernels/few_rows.py: 2..FEW_ROWS_MAX rows against a large weight, else MKL)
and the fused experts (kernels/fused_moe.py: a MoE layer's experts for at most `rows_worth_fusing` rows, else the grouped
torch dispatch). One `LLMEngine` (float32, one thread, the roofline script's settings) on `--preset`: `granite-350m`
(the default; its projections are large enough for the few-rows kernel) or `granite-moe` (its experts). Each round
measures a decode step at every `--batches` size (prompts of `--prompt-len` tokens; the median of the steps after the
prefill) with the kernels on (the defaults) and off, in alternating order. The few-rows kernel alone on the preset's
large projection shapes is timed the same way against MKL. Last line: JSON with `step_ratio` per batch (on over off,
the median of the rounds; below 1 is faster), `projection_ratio` per row count, and every figure.
"""

from __future__ import annotations

import argparse
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
from hybridpd.engine.model.kernels import linear as linear_module
from hybridpd.engine.model.kernels.few_rows import few_rows_linear
from hybridpd.engine.model.layers.moe import GraniteMoE
from hybridpd.presets.checkpoints import write_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import decode_step_s, engine_for  # noqa: E402  (the roofline script's engine and decode timing)


def projection_shapes(engine) -> list[tuple[int, int]]:
    """The distinct 2-D weights of at least FEW_ROWS_MIN_WEIGHT elements the model multiplies by."""
    least = linear_module.FEW_ROWS_MIN_WEIGHT
    return sorted({tuple(p.shape) for name, p in engine.model.named_parameters()
                   if p.dim() == 2 and p.numel() >= least and "embed" not in name and "lm_head" not in name})


def projections_s(shapes: list[tuple[int, int]], rows: int, kernel: bool, repeats: int = 20) -> float:
    if not shapes:
        return 0.0
    weights = [torch.randn(n, k) / k ** 0.5 for n, k in shapes]
    xs = [torch.randn(rows, k) for _, k in shapes]
    product = few_rows_linear if kernel else F.linear
    for x, w in zip(xs, weights):
        product(x, w)
    start = time.perf_counter()
    for _ in range(repeats):
        for x, w in zip(xs, weights):
            product(x, w)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--preset", default="granite-350m", choices=["granite-350m", "granite-moe"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6, help="decode steps measured per batch")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    keep_freed_memory()
    torch.set_num_threads(1)
    few_rows_max = linear_module.FEW_ROWS_MAX
    steps: dict[tuple[bool, int], list[float]] = {}
    projections: dict[tuple[bool, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(args.preset, Path(tmp) / args.preset)
        engine = engine_for(model_dir, "float32", max(args.batches), 4096)
        shapes = projection_shapes(engine)
        moe_layers = [m for m in engine.model.modules() if isinstance(m, GraniteMoE)]
        fused_max_rows = [m.fused_max_rows for m in moe_layers]

        def use_kernels(on: bool) -> None:
            linear_module.FEW_ROWS_MAX = few_rows_max if on else 0
            for layer, rows in zip(moe_layers, fused_max_rows):
                layer.fused_max_rows = rows if on else 0

        for k in range(args.rounds):
            print(f"round {k + 1}/{args.rounds} ...", file=sys.stderr, flush=True)
            for kernel in ((True, False) if k % 2 == 0 else (False, True)):
                use_kernels(kernel)
                for batch in args.batches:
                    steps.setdefault((kernel, batch), []).append(decode_step_s(engine, batch, args.prompt_len,
                                                                               args.steps))
                    projections.setdefault((kernel, batch), []).append(projections_s(shapes, batch, kernel))
        use_kernels(True)

    def median_ms(table, kernel, batch) -> float:
        return statistics.median(table[kernel, batch]) * 1e3

    def projection_ratio(batch: int) -> float | None:
        return median_ms(projections, True, batch) / median_ms(projections, False, batch) if shapes else None

    print(json.dumps({
        "preset": args.preset, "cpu": this_cpus_model(), "date": time.strftime("%Y-%m-%d"), "rounds": args.rounds,
        "few_rows_max": few_rows_max, "fused_moe_max_rows": sorted(set(fused_max_rows)), "projection_shapes": shapes,
        "step_ratio": {b: median_ms(steps, True, b) / median_ms(steps, False, b) for b in args.batches},
        "projection_ratio": {b: projection_ratio(b) for b in args.batches},
        "step_ms": {b: {"on": median_ms(steps, True, b), "off": median_ms(steps, False, b)} for b in args.batches},
        "projection_ms": {b: {"kernel": median_ms(projections, True, b), "mkl": median_ms(projections, False, b)}
                          for b in args.batches},
        "note": "the few-rows kernel takes 2..few_rows_max rows (batch 1 runs MKL both ways)",
    }))


if __name__ == "__main__":
    main()
