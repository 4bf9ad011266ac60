"""Output tokens/s of our engine on 16 concurrent greedy requests, over transformers' batched and sequential `generate`.

Both sides run the default preset's checkpoint (written into a temporary directory from its fixed seed) with
the same torch thread count. Ours: every request is added to one `LLMEngine`, then `step()` runs while it has
work (continuous batching: one batched prefill, then batched decode steps). Theirs: `GraniteMoeHybridForCausalLM`
(transformers' default attention implementation, KV/Mamba cache on) runs `generate` greedy, exactly `output_len`
new tokens: batched (the headline baseline, the best transformers does here: every prompt in one batch — they have
equal lengths, so no padding), and one prompt after the other (`ratio_sequential`). It is loaded by tests/oracle/reference.py (the oracle tests'
reference, with the two extension keys patched in; its window mask also works with `generate`'s cache).

The process keeps the memory it frees (glibc's trim and mmap thresholds raised, hybridpd/engine/host_memory.py),
as `hybridpd serve` does; being process-wide it applies to both sides (`--no-malloc-tuning` measures glibc's
defaults, where both sides page-fault on memory returned to the kernel between steps).

The runs are interleaved (ours, a third of theirs, ours, ...) so that other load on the machine falls on both;
ours is the median of its runs (wall clock). Last line: JSON with `ratio_batched` and `ratio_sequential` = ours / theirs
(output tokens/s, wall clock), the figures, `ratio_cpu_time` (the same from this process's CPU time, steadier on a shared machine) and
`same_tokens` / `same_tokens_batched` = the fraction of requests whose greedy outputs agree token for token (a
sanity check, not a goal): `generate(min_new_tokens=...)` masks EOS while we ignore EOS but may still sample it, so
a request whose argmax is EOS somewhere differs from there on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridpd.config import CacheConfig, EngineConfig, SchedulerConfig
from hybridpd.engine.engine import LLMEngine
from hybridpd.engine.host_memory import keep_freed_memory
from hybridpd.presets.checkpoints import DEFAULT_PRESET, write_checkpoint
from hybridpd.engine.request import EngineRequest
from hybridpd.engine.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests/
from tests.oracle.reference import load_reference  # noqa: E402


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    generator = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, vocab, (length,), generator=generator).tolist()) for _ in range(num)]


@dataclass(frozen=True, kw_only=True)
class Run:
    tokens: int
    wall: float  # seconds
    cpu: float   # this process's CPU seconds (less sensitive to other load on the machine)
    outputs: list[list[int]]
    step_seconds: tuple[float, ...] = ()  # ours: each engine step (the first one is the batched prefill)


def run_ours(model_dir: Path, prompts: list[tuple[int, ...]], output_len: int, threads: int) -> Run:
    config = EngineConfig(
        model_dir=model_dir, threads=threads,
        cache=CacheConfig(num_blocks=len(prompts) * (-(-(len(prompts[0]) + output_len) // 16) + 2)),
        scheduler=SchedulerConfig(max_num_seqs=len(prompts), max_num_batched_tokens=len(prompts) * len(prompts[0])),
    )
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    steps: list[float] = []
    start, start_cpu = time.perf_counter(), time.process_time()
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(request_id=str(i), prompt_token_ids=prompt, sampling=params))
    while engine.has_work():
        step_start = time.perf_counter()
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        steps.append(time.perf_counter() - step_start)
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    ordered = [outputs[str(i)] for i in range(len(prompts))]
    return Run(tokens=sum(len(o) for o in ordered), wall=wall, cpu=cpu, outputs=ordered, step_seconds=tuple(steps))


@torch.inference_mode()
def run_transformers_batched(model, prompts: list[tuple[int, ...]], output_len: int) -> Run:
    """One `generate` over all prompts as one batch (equal lengths: no padding, no attention-mask effects)."""
    ids = torch.tensor(prompts)
    start, start_cpu = time.perf_counter(), time.process_time()
    generated = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=output_len,
        min_new_tokens=output_len, pad_token_id=model.config.eos_token_id,
    )
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    outputs = [row[len(prompts[0]):].tolist() for row in generated]
    return Run(tokens=sum(len(o) for o in outputs), wall=wall, cpu=cpu, outputs=outputs)


@torch.inference_mode()
def run_transformers(model, prompts: list[tuple[int, ...]], output_len: int) -> Run:
    outputs = []
    start, start_cpu = time.perf_counter(), time.process_time()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        generated = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=output_len,
            min_new_tokens=output_len, pad_token_id=model.config.eos_token_id,
        )
        outputs.append(generated[0, len(prompt) :].tolist())
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    return Run(tokens=sum(len(o) for o in outputs), wall=wall, cpu=cpu, outputs=outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both sides")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--preset", default=DEFAULT_PRESET)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="runs of ours, interleaved with slices of theirs")
    parser.add_argument("--skip-transformers", action="store_true", help="only measure ours (for profiling)")
    parser.add_argument("--sequential", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure transformers one prompt at a time (ratio_sequential)")
    parser.add_argument("--malloc-tuning", action=argparse.BooleanOptionalAction, default=True,
                        help="keep freed memory in the process (glibc thresholds), as `hybridpd serve` does; "
                        "it applies to the whole process, so to both sides")
    args = parser.parse_args()
    malloc_tuned = keep_freed_memory() if args.malloc_tuning else False
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(args.preset, Path(tmp))
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        prompts = make_prompts(args.num_requests, args.prompt_len, min(vocab, 256), args.seed)
        run_ours(model_dir, prompts[:2], 4, args.threads)  # warm-up
        reference = None if args.skip_transformers else load_reference(model_dir, eager=False)
        if reference is not None:
            run_transformers_batched(reference, prompts[:2], 4)  # warm-up
        # Interleaved (ours, theirs batched, a slice of theirs sequential, ...) so that load from elsewhere on the
        # machine falls on every side alike; ours and batched are the medians of their runs, sequential the sum over
        # its slices.
        ours: list[Run] = []
        batched: list[Run] = []
        theirs: list[Run] = []
        slices = [prompts[i :: args.repeats] for i in range(args.repeats)]
        for part in slices:
            ours.append(run_ours(model_dir, prompts, args.output_len, args.threads))
            print(f"ours: {ours[-1].tokens / ours[-1].wall:.1f} output tok/s", flush=True)
            if reference is None:
                continue
            torch.set_num_threads(args.threads)
            batched.append(run_transformers_batched(reference, prompts, args.output_len))
            print(f"transformers batched: {batched[-1].tokens / batched[-1].wall:.1f} output tok/s", flush=True)
            if args.sequential:
                theirs.append(run_transformers(reference, part, args.output_len))
                print(f"transformers: {theirs[-1].tokens / theirs[-1].wall:.1f} output tok/s ({len(part)} requests)",
                      flush=True)

    mid = sorted(ours, key=lambda r: r.wall)[len(ours) // 2]
    ours_tok_s, ours_cpu_tok_s = mid.tokens / mid.wall, mid.tokens / mid.cpu
    theirs_tok_s = theirs_cpu_tok_s = same = batched_tok_s = batched_cpu_tok_s = same_batched = float("nan")
    if batched:
        best = sorted(batched, key=lambda r: r.wall)[len(batched) // 2]
        batched_tok_s, batched_cpu_tok_s = best.tokens / best.wall, best.tokens / best.cpu
        same_batched = sum(a == b for a, b in zip(best.outputs, mid.outputs)) / len(prompts)
    if theirs:
        tokens = sum(r.tokens for r in theirs)
        theirs_tok_s = tokens / sum(r.wall for r in theirs)
        theirs_cpu_tok_s = tokens / sum(r.cpu for r in theirs)
        their_outputs = {prompt: out for part, r in zip(slices, theirs) for prompt, out in zip(part, r.outputs)}
        same = sum(their_outputs[p] == o for p, o in zip(prompts, mid.outputs)) / len(prompts)
    print(json.dumps({
        "preset": args.preset,
        "ratio_batched": ours_tok_s / batched_tok_s, "ratio_sequential": ours_tok_s / theirs_tok_s,
        "ours_tok_s": ours_tok_s, "transformers_batched_tok_s": batched_tok_s, "transformers_tok_s": theirs_tok_s,
        "ratio_batched_cpu_time": ours_cpu_tok_s / batched_cpu_tok_s, "same_tokens_batched": same_batched,
        "threads": args.threads, "num_requests": args.num_requests, "prompt_len": args.prompt_len,
        "output_len": args.output_len, "ratio_cpu_time": ours_cpu_tok_s / theirs_cpu_tok_s,
        "same_tokens": same, "malloc_tuned": malloc_tuned,
        # where ours spends its time (the median run): the first step prefills every prompt at once
        "ours_first_step_s": mid.step_seconds[0],
        "ours_mean_later_step_ms": statistics.fmean(mid.step_seconds[1:]) * 1e3,
    }))


if __name__ == "__main__":
    main()
