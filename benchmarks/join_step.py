"""A decode node's step in which a remotely prefilled request joins, and the steps it decodes in, with one of the
engine's paths on and off, side by side in one process, rounds alternated.

`LLMEngine`s on the same checkpoint (one thread each, the default preset, two a setup), each decoding a few short requests
as a P/D decode node does; every `--join-every` steps a request with a `--prompt-len`-token prompt arrives as if
pulled (its KV "arrives" at once: a loader that completes at the next step, so the pulled blocks are not written
first, as a transfer would write them). The step in which it joins, the later steps it decodes in beside the short
ones, and the steps without it are timed apart. `--compare` picks the path:
- `prefault` (the default): two engines fault the memory of the next blocks in ahead (kv_cache/prefault.py), two
  have that switched off, as before it existed; the pools start empty, so every block either engine hands out is
  new memory, as in a node's first minutes;
- `runs`: two engines read the decode buffers in two runs of rows where one long row beside short ones makes that
  pay (`runs_of_rows` in model/step/decode_kv.py), two read every row over the longest row's keys.
Last line: JSON with `join_step_ratio` (the median join step, the path on over off), the same for the other steps
and for the later steps beside the pulled request (`beside_step_ratio`), the minor page faults of the engines'
steps, the CPU, the date and every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from hybridpd.engine.dtype_choice import this_cpus_model
from hybridpd.engine.engine import LLMEngine
from hybridpd.engine.host_memory import keep_freed_memory
from hybridpd.engine.request import EngineRequest
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.presets.checkpoints import write_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests/
from roofline import engine_for  # noqa: E402  (the roofline script's engine)
from tests.unit.engine.engine_harness import remote_params_for  # noqa: E402  (what a prefill node would answer)
from tests.unit.engine.sched_harness import FakeLoader  # noqa: E402  (pulls this script completes itself)

SETUPS = {"prefault": ("ahead", "without"), "runs": ("two runs", "one run")}


def switch_off(engine: LLMEngine, compare: str) -> None:
    """The engine's path under comparison replaced by what it does without it."""
    if compare == "prefault":
        engine.storage.prefault_ahead = lambda upcoming: None
        return
    decode_kv = engine.model.decode_kv
    plan = decode_kv.plan

    def one_run(*args, **kwargs):
        result = plan(*args, **kwargs)
        if result is None:
            return None
        return dataclasses.replace(result, runs=((0, result.positions.shape[0], result.start, result.length),))

    decode_kv.plan = one_run


class Driver:
    def __init__(self, engine: LLMEngine, args: argparse.Namespace, seed: int) -> None:
        self.engine, self.args = engine, args
        self.loader = FakeLoader()
        engine.set_remote(self.loader, hold_handler=lambda seq, logprob: {}, decode_skip_mamba_align=True)
        self.generator = torch.Generator().manual_seed(seed)
        self.count = 0
        self.pulled: set[str] = set()

    def add(self, prompt_len: int, max_tokens: int, remote: bool) -> None:
        self.count += 1
        if remote:
            self.pulled.add(f"r{self.count}")
        prompt = tuple(torch.randint(3, 500, (prompt_len,), generator=self.generator).tolist())
        self.engine.add_request(EngineRequest(
            request_id=f"r{self.count}", prompt_token_ids=prompt,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            kv_transfer=remote_params_for(self.engine, prompt_len) if remote else None))

    def timed_step(self) -> tuple[float, int]:
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        start = time.perf_counter()
        self.engine.step()
        return time.perf_counter() - start, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults

    def round(self) -> dict[str, list[float]]:
        """`--steps` steps beside `--batch` short requests, a pulled one joining every `--join-every`."""
        args = self.args
        figures: dict[str, list[float]] = {"join": [], "other": [], "beside": [], "join_faults": [], "other_faults": []}
        for i in range(args.steps):
            while len(self.engine.request_ids()) < args.batch:   # short requests of 64 tokens, replaced as they end
                self.add(32, 64, remote=False)
            if i % args.join_every == args.join_every // 2:
                self.add(args.prompt_len, 4, remote=True)
                self.engine.step()   # admission: the pull starts
                for request_id, _, _ in self.loader.started:   # the pull completes at once: nothing is transferred
                    self.engine.complete_load(request_id)
                self.loader.started.clear()
                kind = "join"
            else:
                kind = "other"
            beside = kind == "other" and not self.pulled.isdisjoint(self.engine.request_ids())
            seconds, faults = self.timed_step()
            figures[kind].append(1000 * seconds)
            figures[f"{kind}_faults"].append(faults)
            if beside:
                figures["beside"].append(1000 * seconds)
        return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--compare", choices=sorted(SETUPS), default="prefault")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=3, help="short requests decoding beside the joins")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--join-every", type=int, default=20)
    parser.add_argument("--steps", type=int, default=300, help="steps per round and engine")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    keep_freed_memory()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(args.preset, Path(tmp) / args.preset)
        # Two engines a setup, made in the order on, off, off, on: an engine made first steps a few percent faster or
        # slower than one made later (measured with both engines the same), which this cancels.
        setups = SETUPS[args.compare]
        drivers: list[tuple[str, Driver]] = []
        for k, setup in enumerate(setups + setups[::-1]):
            engine = engine_for(model_dir, "float32", 64, 4096)
            if setup == setups[1]:
                switch_off(engine, args.compare)
            drivers.append((setup, Driver(engine, args, seed=k)))
        figures: dict[str, dict[str, list[float]]] = {s: {} for s in setups}
        for r in range(args.rounds):
            for setup, driver in (drivers if r % 2 == 0 else drivers[::-1]):
                for key, values in driver.round().items():
                    figures[setup].setdefault(key, []).extend(values)
            print(json.dumps({"round": r, **{s: {k: round(statistics.median(v), 2) for k, v in f.items()}
                                             for s, f in figures.items()}}), flush=True)
        for _, driver in drivers:
            driver.engine.close()

    def median(setup: str, key: str) -> float:
        return statistics.median(figures[setup][key])

    def p90(setup: str, key: str) -> float:
        return statistics.quantiles(figures[setup][key], n=10)[8]

    on, off = setups
    print(json.dumps({
        "compare": args.compare, "preset": args.preset, "cpu": this_cpus_model(),
        "date": datetime.date.today().isoformat(),
        **{f"{kind}_step_ratio": round(median(on, kind) / median(off, kind), 3) for kind in ("join", "other", "beside")},
        "ms": {s: {f"{kind}_{q}": round(f(s, kind), 2) for kind in ("join", "other", "beside")
                   for q, f in (("p50", median), ("p90", p90))} for s in setups},
        # minor page faults of the engine's thread per step, median and mean (a huge page is one fault)
        "faults_per_step": {s: {kind: {"median": statistics.median(figures[s][f"{kind}_faults"]),
                                       "mean": round(statistics.mean(figures[s][f"{kind}_faults"]), 2)}
                                for kind in ("join", "other")} for s in setups},
        "workload": vars(args),
    }))


if __name__ == "__main__":
    main()
