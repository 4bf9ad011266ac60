"""A decode node's step in which a remotely prefilled request joins, with the KV pool's memory faulted in ahead and
without, side by side in one process, rounds alternated.

`LLMEngine`s on the same checkpoint (one thread each, the default preset, two a setup), each decoding a few short requests
as a P/D decode node does; every `--join-every` steps a request with a `--prompt-len`-token prompt arrives as if
pulled (its KV "arrives" at once: a loader that completes at the next step, so the pulled blocks are not written
first, as a transfer would write them). The step in which it joins and the other steps are timed apart. Two engines
fault the memory of the next blocks in ahead (the engine's own path, kv_cache/prefault.py), two have that switched
off, as before it existed; the pools start empty, so every block either engine hands out is new memory, as
in a node's first minutes. Last line: JSON with `join_step_ratio` (the median join step, ahead over without), the
same for the other steps, the minor page faults of the engines' steps, the CPU, the date and every figure.
"""

from __future__ import annotations

import argparse
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

SETUPS = ("ahead", "without")


class InstantLoader:
    """Pulls that complete before the next step (nothing is transferred)."""

    def __init__(self) -> None:
        self.started: list[str] = []

    def start_load(self, seq, hit_tokens, blocks) -> None:
        self.started.append(seq.request_id)

    def discard(self, seq) -> None:
        pass


class Driver:
    def __init__(self, engine: LLMEngine, args: argparse.Namespace, seed: int) -> None:
        self.engine, self.args = engine, args
        self.loader = InstantLoader()
        engine.set_remote(self.loader, hold_handler=lambda seq, logprob: {}, decode_skip_mamba_align=True)
        self.generator = torch.Generator().manual_seed(seed)
        self.count = 0

    def add(self, prompt_len: int, max_tokens: int, remote: bool) -> None:
        self.count += 1
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
        args, figures = self.args, {"join": [], "other": [], "join_faults": [], "other_faults": []}
        for i in range(args.steps):
            while len(self.engine.request_ids()) < args.batch:   # short requests of 64 tokens, replaced as they end
                self.add(32, 64, remote=False)
            if i % args.join_every == args.join_every // 2:
                self.add(args.prompt_len, 4, remote=True)
                self.engine.step()   # admission: the pull starts
                for request_id in self.loader.started:
                    self.engine.complete_load(request_id)
                self.loader.started.clear()
                kind = "join"
            else:
                kind = "other"
            seconds, faults = self.timed_step()
            figures[kind].append(1000 * seconds)
            figures[f"{kind}_faults"].append(faults)
        return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
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
        # Two engines a setup, made in the order ahead, without, without, ahead: an engine made first steps a few
        # percent faster or slower than one made later (measured with both engines the same), which this cancels.
        drivers: list[tuple[str, Driver]] = []
        for k, setup in enumerate(SETUPS + SETUPS[::-1]):
            engine = engine_for(model_dir, "float32", 64, 4096)
            if setup == "without":
                engine.storage.prefault_ahead = lambda upcoming: None
            drivers.append((setup, Driver(engine, args, seed=k)))
        figures: dict[str, dict[str, list[float]]] = {s: {} for s in SETUPS}
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

    print(json.dumps({
        "preset": args.preset, "cpu": this_cpus_model(), "date": datetime.date.today().isoformat(),
        "join_step_ratio": round(median("ahead", "join") / median("without", "join"), 3),
        "other_step_ratio": round(median("ahead", "other") / median("without", "other"), 3),
        "ms": {s: {"join_p50": round(median(s, "join"), 2), "join_p90": round(p90(s, "join"), 2),
                   "other_p50": round(median(s, "other"), 2), "other_p90": round(p90(s, "other"), 2)}
               for s in SETUPS},
        # minor page faults of the engine's thread per step, median and mean (a huge page is one fault)
        "faults_per_step": {s: {kind: {"median": statistics.median(figures[s][f"{kind}_faults"]),
                                       "mean": round(statistics.mean(figures[s][f"{kind}_faults"]), 2)}
                                for kind in ("join", "other")} for s in SETUPS},
        "workload": vars(args),
    }))


if __name__ == "__main__":
    main()
