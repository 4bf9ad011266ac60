"""float32's products through oneDNN against MKL's, on one engine, side by side in one process.

One `LLMEngine` on `--preset` (float32, one thread, prefix caching off) computes, in each setting: decode steps at
each of `--batches` (that many requests of 32 prompt tokens decoding; the median of the steps after their prompts),
then one `--prefill-len`-token prompt alone (its time to the first token). `--compare` picks the two settings,
alternated round by round on the same engine:
- `packs` (the default): `onednn`, float32's products through the packed weights (kernels/packed.py), as on a CPU
  with AVX-512 whose MKL runs generic code, the prefill's attention through oneDNN's products
  (kernels/product_attention.py) with them; `mkl`, float32's products through MKL (`F.linear`) and the few-rows
  kernel, the attention through SDPA. Both keep the one-row kernel where MKL runs generic code
  (`linear.own_loops_pay`), as the engine does.
- `rows`: without packs, a step of a whole multiple of `linear.ONEDNN_ROWS` rows through oneDNN's unpacked product
  (`onednn`) or MKL's (`mkl`): a `--prefill-len` of 1,024 or 2,048 takes it.

Last line: JSON with `onednn_over_mkl` (each figure's median through oneDNN over through MKL: below 1, oneDNN pays
here), `default` (the setting this CPU takes), the figures, CPU and date.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import hybridpd.engine.model.kernels.linear as linear_module
from hybridpd.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridpd.engine.dtype_choice import this_cpus_model
from hybridpd.engine.engine import LLMEngine
from hybridpd.engine.request import EngineRequest
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.presets.checkpoints import default_model_dir

SHORT_PROMPT = 32


class Workload:
    def __init__(self, engine: LLMEngine, args: argparse.Namespace) -> None:
        self.engine, self.args = engine, args
        self.generator = torch.Generator().manual_seed(0)
        self.added = 0

    def add(self, length: int, max_tokens: int) -> None:
        self.added += 1
        ids = tuple(torch.randint(0, 250, (length,), generator=self.generator).tolist())
        self.engine.add_request(EngineRequest(request_id=f"r{self.added}", prompt_token_ids=ids, sampling=SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))

    def measure(self) -> dict[str, float]:
        engine, args = self.engine, self.args
        figures = {}
        for batch in args.batches:
            for _ in range(batch):
                self.add(SHORT_PROMPT, args.max_model_len - SHORT_PROMPT)
            while engine.scheduler.waiting or any(seq.num_computed_tokens < seq.num_prompt_tokens
                                                  for seq in engine.scheduler.running):
                engine.step()
            engine.step()
            steps = []
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - start)
            figures[f"decode_ms_batch_{batch}"] = statistics.median(steps) * 1e3
            for request_id in list(engine.request_ids()):
                engine.abort(request_id)
        self.add(args.prefill_len, 1)
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
        figures[f"prefill_ms_{args.prefill_len}"] = (time.perf_counter() - start) * 1e3
        return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", choices=("packs", "rows"), default="packs")
    parser.add_argument("--preset", default="small-vllm")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prefill-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per batch")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1 or min(args.batches) < 1 or args.prefill_len < 1:
        parser.error("--rounds, --steps, --batches and --prefill-len must be positive")

    torch.set_num_threads(1)
    packs, onednn = linear_module._f32_packing, linear_module._onednn
    settings = {   # (float32 packs, oneDNN's whole multiples of rows) per setting
        "packs": {"onednn": (True, onednn), "mkl": (False, onednn)},
        "rows": {"onednn": (False, linear_module._find_onednn()), "mkl": (False, None)},
    }[args.compare]
    default = packs if args.compare == "packs" else onednn is not None
    engine = LLMEngine(EngineConfig(model_dir=default_model_dir(args.preset), dtype="float32", threads=1,
                                    cache=CacheConfig(enable_prefix_caching=False),
                                    scheduler=SchedulerConfig(max_model_len=args.max_model_len, max_num_seqs=64)))
    workload = Workload(engine, args)
    figures: dict[str, list[dict[str, float]]] = {"onednn": [], "mkl": []}
    try:
        workload.measure()   # warm-up: every path's first call
        for r in range(args.rounds):
            for setting in ("onednn", "mkl") if r % 2 == 0 else ("mkl", "onednn"):
                linear_module._f32_packing, linear_module._onednn = settings[setting]
                figures[setting].append(workload.measure())
                print(f"round {r} {setting}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures[setting][-1].items()),
                      flush=True)
    finally:
        linear_module._f32_packing, linear_module._onednn = packs, onednn
        engine.close()
    medians = {setting: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
               for setting, runs in figures.items()}
    print(json.dumps({
        "onednn_over_mkl": {key: round(medians["onednn"][key] / medians["mkl"][key], 3) for key in medians["mkl"]},
        "compare": args.compare, "default": "onednn" if default else "mkl",
        "ms": {setting: {key: round(value, 2) for key, value in m.items()} for setting, m in medians.items()},
        "preset": args.preset, "rounds": args.rounds, "cpu": this_cpus_model(), "date": time.strftime("%Y-%m-%d"),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
