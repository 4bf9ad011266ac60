"""What scoring a prompt costs: a prefill that returns every prompt token's logprob (`prompt_logprobs`, what
lm-evaluation-harness's loglikelihood requests ask for through `echo` and `logprobs`) against the same prefill that
returns only its next token, on one engine, rounds alternated, the prefix cache emptied before each prefill.

The extra work is the vocabulary projection of every prompt row instead of the last (a slice of rows at a time), a
log-softmax over each and the top tokens. Last line: JSON with `scoring_over_plain` (the median of the rounds'
ratios of the two prefills' times), the figures, the CPU and the date.
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
from hybridpd.engine.engine import LLMEngine
from hybridpd.engine.host_memory import keep_freed_memory
from hybridpd.engine.request import EngineRequest
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.presets.checkpoints import write_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import engine_for  # noqa: E402  (the roofline script's engine: one thread, a large KV pool)


def prefill_s(engine: LLMEngine, prompt: tuple[int, ...], prompt_logprobs: int | None) -> float:
    engine.kv.reset_prefix_cache()
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    engine.add_request(EngineRequest(request_id="p", prompt_token_ids=prompt, sampling=params))
    start = time.perf_counter()
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    elapsed = time.perf_counter() - start
    scored = outputs[0].prompt_logprobs
    if (scored is not None) != (prompt_logprobs is not None) or (scored is not None and len(scored) != len(prompt)):
        raise RuntimeError("the scoring prefill did not return one entry per prompt token")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--preset", default="granite-350m")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--top", type=int, default=1, help="prompt_logprobs: the top tokens beside each")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    keep_freed_memory()
    torch.set_num_threads(1)
    prompt = tuple(torch.randint(3, 500, (args.prompt_len,), generator=torch.Generator().manual_seed(3)).tolist())
    times: dict[str, list[float]] = {"plain": [], "scoring": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(args.preset, Path(tmp) / args.preset)
        engine = engine_for(model_dir, args.dtype, 1, args.prompt_len)
        prefill_s(engine, prompt, None)   # warm up at full length: compiled kernels, first-touch memory
        prefill_s(engine, prompt, args.top)
        for r in range(args.rounds):
            for kind in (("plain", "scoring") if r % 2 == 0 else ("scoring", "plain")):
                times[kind].append(prefill_s(engine, prompt, args.top if kind == "scoring" else None))
    ratios = [s / p for s, p in zip(times["scoring"], times["plain"])]
    print(json.dumps({
        "scoring_over_plain": round(statistics.median(ratios), 3),
        "per_round": [round(r, 3) for r in ratios],
        "plain_s": [round(t, 3) for t in times["plain"]], "scoring_s": [round(t, 3) for t in times["scoring"]],
        "preset": args.preset, "dtype": args.dtype, "prompt_len": args.prompt_len, "top": args.top,
        "cpu": this_cpus_model(), "date": datetime.date.today().isoformat(),
    }))


if __name__ == "__main__":
    main()
