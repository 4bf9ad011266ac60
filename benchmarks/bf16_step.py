"""bfloat16 against float32 on one preset, side by side in one process, rounds alternated.

Two `LLMEngine`s on the same checkpoint (one thread, the roofline script's settings), one per dtype. Each round
measures, for each engine in alternating order, a decode step at every `--batches` size (prompts of `--prompt-len`
tokens; the median of the steps after the prefill) and one `--prefill-len`-token prefill. On a CPU with bfloat16
units the bfloat16 steps should be the faster (half the bytes to read, products in the units); on one without, they
show what the emulation costs after the engine's own bfloat16 paths (kernels/linear.py's `bf16_linear`, the compiled
kernels on bfloat16 bits). Last line: JSON with `bf16_over_f32` per batch and for the prefill (the median of the
rounds' ratios; below 1 is faster in bfloat16), the CPU, the date, and every figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from hybridpd.engine.dtype_choice import BF16_FLAGS, this_cpus_flags, this_cpus_model
from hybridpd.engine.host_memory import keep_freed_memory
from hybridpd.presets.checkpoints import write_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import decode_step_s, engine_for, prefill_s  # noqa: E402  (the roofline script's engine and timings)

DTYPES = ("float32", "bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--preset", default="small-vllm")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=12, help="decode steps measured per batch")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    keep_freed_memory()
    torch.set_num_threads(1)
    figures: dict[str, dict[str, list[float]]] = {d: {} for d in DTYPES}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(args.preset, Path(tmp) / args.preset)
        engines = {d: engine_for(model_dir, d, max(args.batches), max(args.prefill_len,
                                                                      max(args.batches) * args.prompt_len))
                   for d in DTYPES}
        for d, engine in engines.items():   # warm up: compiled kernels, first-touch memory
            decode_step_s(engine, max(args.batches), args.prompt_len, 2)
            prefill_s(engine, 64)
        for r in range(args.rounds):
            for d in (DTYPES if r % 2 == 0 else DTYPES[::-1]):
                engine = engines[d]
                for batch in args.batches:
                    engine.kv.reset_prefix_cache()   # every round computes its prompts (they repeat)
                    figures[d].setdefault(str(batch), []).append(
                        1000 * decode_step_s(engine, batch, args.prompt_len, args.steps))
                engine.kv.reset_prefix_cache()
                figures[d].setdefault("prefill", []).append(1000 * prefill_s(engine, args.prefill_len))
            print(json.dumps({"round": r, **{d: {k: round(v[-1], 2) for k, v in f.items()}
                                             for d, f in figures.items()}}), flush=True)
    keys = [str(b) for b in args.batches] + ["prefill"]
    ratios = {k: round(statistics.median(b / f for b, f in zip(figures["bfloat16"][k], figures["float32"][k])), 3)
              for k in keys}
    print(json.dumps({
        "preset": args.preset, "cpu": this_cpus_model(), "bf16_units": sorted(this_cpus_flags() & BF16_FLAGS),
        "date": datetime.date.today().isoformat(),
        "bf16_over_f32": ratios,
        "ms": {d: {k: [round(v, 2) for v in figures[d][k]] for k in keys} for d in DTYPES},
    }))


if __name__ == "__main__":
    main()
