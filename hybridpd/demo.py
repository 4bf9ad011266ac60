"""`make demo`: a 1 prefill + 1 decode cluster on the default model, a prefix-repetition workload
through the proxy with `hybridpd bench`, then TTFT, ITL and the decode side's prefix hit rate.

The hit rate is the decode node's own local prefix hit (`usage.prompt_tokens_details.cached_tokens`
of its answers, which the proxy passes through): prompts that share a prefix find its full-attention
blocks already on the decode node, so only the rest is pulled from the prefill node.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hybridpd.launcher.cluster import LocalCluster
from hybridpd.launcher.errors import ClusterError
from hybridpd.launcher.ports import free_cluster_ports
from hybridpd.launcher.spec import ClusterInfo, ClusterSpec

RESULT_FILE = "demo-bench.json"
BENCH_TIMEOUT = 900.0  # seconds; the workload takes well under a minute on 2 cores
WORKLOAD = (
    "--dataset-name", "prefix_repetition",
    "--prefix-repetition-prefix-len", "128",
    "--prefix-repetition-suffix-len", "32",
    "--prefix-repetition-num-prefixes", "2",
    "--prefix-repetition-output-len", "16",
    "--num-prompts", "16",
    "--max-concurrency", "4",
    "--seed", "0",
)


def bench_command(info: ClusterInfo, result_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "hybridpd", "bench", "--base-url", info.proxy_url, "--endpoint", "/v1/completions",
        *WORKLOAD, "--metrics-url", *[node.metrics_url for node in info.nodes],
        "--disable-tqdm", "--save-result", "--result-dir", str(result_dir), "--result-filename", RESULT_FILE,
    ]


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:8.1f} ms"


def _mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.2f} MiB"


def summary(result: dict[str, Any]) -> str:
    hit = result.get("prefix_cache_hit_rate")
    return "\n".join([
        "==================== hybridpd demo ====================",
        f"requests completed / failed : {result['completed']} / {result['failed']}",
        f"TTFT mean / p99             : {_ms(result.get('mean_ttft_ms'))} / {_ms(result.get('p99_ttft_ms'))}",
        f"ITL  mean / p99             : {_ms(result.get('mean_itl_ms'))} / {_ms(result.get('p99_itl_ms'))}",
        f"decode-side prefix hit rate : {'n/a' if hit is None else f'{hit:.1%}'}",
        f"KV read by the decode node  : {_mib(result.get('kv_bytes_read'))}",
        "=======================================================",
    ])


def main() -> int:
    run_dir = Path(tempfile.mkdtemp(prefix="hybridpd-demo-"))
    proxy_port, base_port = free_cluster_ports(2)
    spec = ClusterSpec(num_prefill=1, num_decode=1, port=proxy_port, base_port=base_port, run_dir=run_dir)
    print(f"hybridpd demo: starting 1 prefill + 1 decode node on the default model (logs in {run_dir}) ...",
          flush=True)
    try:
        with LocalCluster(spec) as info:
            print(info.describe(), flush=True)
            bench = subprocess.run(bench_command(info, run_dir), timeout=BENCH_TIMEOUT, check=False)
            print("hybridpd demo: stopping the cluster ...", flush=True)
    except ClusterError as exc:
        print(f"hybridpd demo: the cluster failed: {exc}", file=sys.stderr)
        return 1
    result_path = run_dir / RESULT_FILE
    if bench.returncode != 0 or not result_path.exists():
        print(f"hybridpd demo: `hybridpd bench` failed (exit {bench.returncode})", file=sys.stderr)
        return 1
    result = json.loads(result_path.read_text())
    print(summary(result))
    return 0 if result["completed"] > 0 and result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
