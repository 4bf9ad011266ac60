"""The fixed cost of P/D: one request at a time, through the proxy (prefill node, then decode node), against the
same prompt length served colocated on one node; 128, 1,024 and 4,096 prompt tokens, one output token.

One `LocalCluster` on the default preset (1 prefill + 1 decode node, one torch thread each, and the proxy). Per
length and round, with a fresh random prompt each time (no prefix hit anywhere): (a) colocated: the prompt straight
to the decode node; (b) P/D through the proxy; (c) the same two hops called directly, to split (b) into the
prefill-role request, the decode-role request (pull + last token) and what the proxy adds on top. Rounds alternate
(a) and (b), and each figure is the median of `--rounds`.

Last line: JSON with `added_ms_128`, `added_ms_1024`, `added_ms_4096` (P/D minus colocated, ms), `added_ratio_4096`
(the same over colocated) and per length the parts: `prefill_role_ms`, `decode_role_ms`, `proxy_ms`, `colocated_ms`,
`pd_ms`, and the decode role split into `pull_ms` (the mean READ, from the decode node's `hybridpd:kv_read_seconds`)
and `decode_step_and_http_ms` (the rest: its HTTP, the step that starts the pull and the step computing the last
prompt token). `proxy_ms` is P/D minus the two hops called directly, so it also carries their run-to-run noise.
Goals (issue 16): at most 5 ms added at 128 tokens, at most 5% at 4,096.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import urllib.request
from typing import Any

from hybridpd.bench.prometheus import counter_sum
from hybridpd.engine.model.presets import default_model_dir
from hybridpd.launcher.cluster import LocalCluster
from hybridpd.launcher.ports import free_cluster_ports
from hybridpd.launcher.spec import ClusterSpec

LENGTHS = (128, 1024, 4096)
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def post(url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(seconds until the whole answer arrived, the answer)."""
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as answer:
        data = json.loads(answer.read())
    return time.perf_counter() - start, data


def read_seconds(metrics_url: str) -> tuple[float, float]:
    """(sum, count) of the decode node's `hybridpd:kv_read_seconds` histogram: its pulls' READ times."""
    with urllib.request.urlopen(metrics_url, timeout=10) as answer:
        text = answer.read().decode()
    return (counter_sum(text, "hybridpd:kv_read_seconds_sum") or 0.0,
            counter_sum(text, "hybridpd:kv_read_seconds_count") or 0.0)


def body_for(length: int, rng: random.Random) -> dict[str, Any]:
    return {"prompt": [rng.randrange(3, 250) for _ in range(length)], "max_tokens": 1, "temperature": 0,
            "ignore_eos": True}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    args = parser.parse_args()
    model = default_model_dir()
    proxy_port, base_port = free_cluster_ports(2)
    spec = ClusterSpec(num_prefill=1, num_decode=1, model_dir=model, port=proxy_port, base_port=base_port,
                       serve_args=("--max-model-len", str(max(args.lengths) + 16), "--max-num-batched-tokens",
                                   str(max(args.lengths) + 16)))
    rng = random.Random(0)
    results: dict[str, Any] = {}
    with LocalCluster(spec) as info:
        prefill_url, decode_url = info.prefill[0].url, info.decode[0].url
        for length in args.lengths:  # warm-up: every path once per length
            post(decode_url, body_for(length, rng))
            post(info.proxy_url, body_for(length, rng))
        for length in args.lengths:
            parts: dict[str, list[float]] = {k: [] for k in ("colocated", "pd", "prefill_role", "decode_role")}
            reads_before = read_seconds(info.decode[0].metrics_url)
            for r in range(args.rounds):
                order = ("colocated", "pd") if r % 2 == 0 else ("pd", "colocated")
                for kind in order:
                    url = decode_url if kind == "colocated" else info.proxy_url
                    parts[kind].append(post(url, body_for(length, rng))[0])
                body = body_for(length, rng)
                seconds, answer = post(prefill_url, {**body, "kv_transfer_params": REMOTE_DECODE})
                parts["prefill_role"].append(seconds)
                seconds, _ = post(decode_url, {**body, "kv_transfer_params": answer["kv_transfer_params"]})
                parts["decode_role"].append(seconds)
            ms = {k: statistics.median(v) * 1e3 for k, v in parts.items()}
            figures = {f"{k}_ms": round(v, 2) for k, v in ms.items()}
            figures["proxy_ms"] = round(ms["pd"] - ms["prefill_role"] - ms["decode_role"], 2)
            reads_after = read_seconds(info.decode[0].metrics_url)
            pulls = reads_after[1] - reads_before[1]
            pull_ms = (reads_after[0] - reads_before[0]) / pulls * 1e3 if pulls else float("nan")
            figures["pull_ms"] = round(pull_ms, 2)                                     # mean READ of a pull
            figures["decode_step_and_http_ms"] = round(ms["decode_role"] - pull_ms, 2)  # the rest of the decode role
            results[str(length)] = figures
            print(f"{length} tokens: {figures}", file=sys.stderr, flush=True)
    out: dict[str, Any] = {"rounds": args.rounds, "lengths": results}
    for length, figures in results.items():
        out[f"added_ms_{length}"] = round(figures["pd_ms"] - figures["colocated_ms"], 2)
    if "4096" in results:
        out["added_ratio_4096"] = round(out["added_ms_4096"] / results["4096"]["colocated_ms"], 4)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
