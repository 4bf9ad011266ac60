"""The fixed cost of P/D: one request at a time, through the proxy (prefill node, then decode node), against the
same prompt length served colocated on one node; 128, 1,024 and 4,096 prompt tokens, streamed, two output tokens.

One `LocalCluster` on the default preset (1 prefill + 1 decode node, one torch thread each, and the proxy). Per
length and round, with a fresh random prompt each time (no prefix hit anywhere): (a) colocated: the prompt straight
to the decode node; (b) P/D through the proxy; (c) the same two hops called directly, as the proxy calls them, to
split (b) into the prefill-role request, the decode-role request and what the proxy adds on top. Rounds alternate
(a) and (b), and each figure is the median of `--rounds`. Every request streams two tokens: the first token comes
with the prefill node's streamed answer (the proxy passes it on before it opens the decode call), the second
carries the decode hop and the pull (the decode node continues the stream: it pulls, then computes the second).

Last line: JSON with `added_ms_128`, `added_ms_1024`, `added_ms_4096` (P/D minus colocated TTFT, ms),
`added_ratio_4096` (the same over colocated), the same for the second token (`added_second_token_ms_*`), and per
length the parts: `colocated_ttft_ms`, `pd_ttft_ms`, `colocated_second_ms`, `pd_second_ms`, `prefill_role_ms` (the
prefill-role request, streamed, until its answer ended), `decode_role_first_ms` (the decode-role request continuing
that stream, called directly: until its first chunk, the second token), `proxy_ms` (P/D TTFT minus the prefill
role: what the proxy adds to the first token, with the run-to-run noise of the two), and `pull_ms` (the mean READ,
from the decode node's `hybridpd:kv_read_seconds`). Goals: at most 5 ms added at 128 tokens, at most 5%
at 4,096.
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
from hybridpd.presets.checkpoints import default_model_dir
from hybridpd.launcher.cluster import LocalCluster
from hybridpd.launcher.ports import free_cluster_ports
from hybridpd.launcher.spec import ClusterSpec
from hybridpd.proxy.bodies import decode_body, prefill_body
from hybridpd.proxy.prefill_stream import read_prefill_stream

LENGTHS = (128, 1024, 4096)


def token_times(url: str, body: dict[str, Any]) -> list[float]:
    """Seconds until each token's chunk of a streamed completion."""
    request = urllib.request.Request(url + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({**body, "stream": True, "return_token_ids": True}).encode())
    start = time.perf_counter()
    times: list[float] = []
    with urllib.request.urlopen(request, timeout=600) as answer:
        for raw in answer:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(f"{url}: {event['error']}")
            for choice in event.get("choices", []):
                times.extend([time.perf_counter() - start] * len(choice.get("token_ids") or ()))
    return times


def stream(url: str, body: dict[str, Any]) -> tuple[float, float]:
    """(seconds until the first token's chunk, until the second token's chunk) of a streamed completion."""
    times = token_times(url, body)
    if len(times) < 2:
        raise RuntimeError(f"{url}: {len(times)} tokens streamed, 2 asked")
    return times[0], times[1]


def prefill_call(url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """The proxy's prefill call, streamed: (seconds until its answer ended, the decode call's body)."""
    request = urllib.request.Request(url + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps(prefill_body(body)).encode())
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as answer:
        answered = read_prefill_stream(answer.read())
    seconds = time.perf_counter() - start
    return seconds, decode_body(body, answered.kv_transfer_params, answered.stream_head)


def read_seconds(metrics_url: str) -> tuple[float, float]:
    """(sum, count) of the decode node's `hybridpd:kv_read_seconds` histogram: its pulls' READ times."""
    with urllib.request.urlopen(metrics_url, timeout=10) as answer:
        text = answer.read().decode()
    return (counter_sum(text, "hybridpd:kv_read_seconds_sum") or 0.0,
            counter_sum(text, "hybridpd:kv_read_seconds_count") or 0.0)


def body_for(length: int, rng: random.Random) -> dict[str, Any]:
    return {"prompt": [rng.randrange(3, 250) for _ in range(length)], "max_tokens": 2, "temperature": 0,
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
            stream(decode_url, body_for(length, rng))
            stream(info.proxy_url, body_for(length, rng))
        for length in args.lengths:
            parts: dict[str, list[float]] = {k: [] for k in (
                "colocated_ttft", "colocated_second", "pd_ttft", "pd_second", "prefill_role", "decode_role_first")}
            reads_before = read_seconds(info.decode[0].metrics_url)
            for r in range(args.rounds):
                order = ("colocated", "pd") if r % 2 == 0 else ("pd", "colocated")
                for kind in order:
                    url = decode_url if kind == "colocated" else info.proxy_url
                    first, second = stream(url, body_for(length, rng))
                    parts[f"{kind}_ttft"].append(first)
                    parts[f"{kind}_second"].append(second)
                seconds, decode = prefill_call(prefill_url, {**body_for(length, rng), "stream": True})
                parts["prefill_role"].append(seconds)
                parts["decode_role_first"].append(token_times(decode_url, decode)[0])
            ms = {k: statistics.median(v) * 1e3 for k, v in parts.items()}
            figures = {f"{k}_ms": round(v, 2) for k, v in ms.items()}
            figures["proxy_ms"] = round(ms["pd_ttft"] - ms["prefill_role"], 2)
            reads_after = read_seconds(info.decode[0].metrics_url)
            pulls = reads_after[1] - reads_before[1]
            figures["pull_ms"] = round((reads_after[0] - reads_before[0]) / pulls * 1e3 if pulls else float("nan"), 2)
            results[str(length)] = figures
            print(f"{length} tokens: {figures}", file=sys.stderr, flush=True)
    out: dict[str, Any] = {"rounds": args.rounds, "lengths": results}
    for length, figures in results.items():
        out[f"added_ms_{length}"] = round(figures["pd_ttft_ms"] - figures["colocated_ttft_ms"], 2)
        out[f"added_second_token_ms_{length}"] = round(figures["pd_second_ms"] - figures["colocated_second_ms"], 2)
    if "4096" in results:
        out["added_ratio_4096"] = round(out["added_ms_4096"] / results["4096"]["colocated_ttft_ms"], 4)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
