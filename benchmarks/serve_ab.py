"""A/B of a change, as a user sees it: `hybridpd serve` of this working tree against `hybridpd serve` of another git
revision, both serving the same checkpoint at once, driven by one client (`hybridpd bench`), rounds alternating.

The other revision is checked out into a temporary git worktree (removed at the end) and run from there (its own
code on `PYTHONPATH`, this venv's packages). Both sides get the same flags: `--threads 1 --engine-cpus 0` (as
`vs_vllm.py` runs ours), 2 GiB of KV cache, no prefix caching, plus `--serve-args`. Workloads and their ratios are
`vs_vllm.py`'s (greedy, random token-id prompts). Last line: JSON {"base", "rounds", "workloads": {name:
{throughput_ratio, mean_ttft_ratio, p99_itl_ratio, this, base}}}, the ratios this tree / the base revision.

    .venv/bin/python benchmarks/serve_ab.py --base HEAD~1 --rounds 4

Run it twice before believing a few percent: on this machine two identical sides differ by up to ~5% per run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_vllm import VLLM_PRESET, WORKLOADS, run_bench, side_by_side, stop_all, wait_ready  # noqa: E402

from hybridpd.launcher.ports import free_port  # noqa: E402

READY_DEADLINE = 300.0
REPO = Path(__file__).resolve().parent.parent


def serve(root: Path, model: Path, port: int, extra: list[str]) -> subprocess.Popen:
    """`hybridpd serve` of the code under `root` (its engine process inherits the same path and directory)."""
    command = [sys.executable, "-m", "hybridpd", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
               "--threads", "1", "--engine-cpus", "0", "--kv-cache-memory", "2GiB", "--no-enable-prefix-caching",
               *extra]
    return subprocess.Popen(command, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                            stdout=subprocess.DEVNULL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the git revision to compare against (e.g. HEAD~1)")
    parser.add_argument("--model", type=Path, default=None, help=f"checkpoint dir (default: the {VLLM_PRESET} preset)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["random_256_64_c16"], choices=list(WORKLOADS))
    parser.add_argument("--serve-args", default="", help="more `hybridpd serve` flags for both sides, one string")
    args = parser.parse_args()
    if args.model is None:
        from hybridpd.presets.checkpoints import default_model_dir
        args.model = default_model_dir(VLLM_PRESET)
    base = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{args.base}^{{commit}}"],
                          capture_output=True, text=True)
    if base.returncode != 0:
        print(f"serve_ab: error: not a revision of {REPO}: {args.base}", file=sys.stderr)
        return 2
    revision = base.stdout.strip()
    with tempfile.TemporaryDirectory(prefix="hybridpd-ab-") as tmp:
        worktree = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(worktree), revision],
                       check=True)
        processes: dict[str, subprocess.Popen] = {}
        try:
            ports = {"this": free_port("127.0.0.1"), "base": free_port("127.0.0.1")}
            for side, root in (("this", REPO), ("base", worktree)):
                processes[side] = serve(root, args.model, ports[side], args.serve_args.split())
            urls = {side: f"http://127.0.0.1:{port}" for side, port in ports.items()}
            for side, url in urls.items():
                wait_ready(url, processes[side], READY_DEADLINE)
            for name in args.workloads:  # warm-up, not counted
                for url in urls.values():
                    run_bench(url, WORKLOADS[name], seed=99)
            results = side_by_side(urls, args.workloads, args.rounds)
        finally:
            stop_all(processes.values())
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)], check=False)
    print(json.dumps({"base": revision, "rounds": args.rounds, "workloads": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
