"""vLLM's Prometheus metrics against vLLM's CPU build: both serve one checkpoint, get the same requests, and their
`/metrics` are compared family by family as an operator's tools read them.

Not a speed figure: an agreement check. Both serve `--preset`'s checkpoint in float32 (vLLM from the venv
`vs_vllm.py` builds), prefix caching off and `--kv-cache-metrics` on (every block followed), and answer the same
completions by token ids: `--prompts` prompts of 8-20 tokens (greedy, 5 tokens each, EOS ignored) and one prompt
with `n` = 2 (sampled: vLLM refuses `n` > 1 with greedy sampling). Then, for every `vllm:` family our node exports:
its type, its label names, each histogram's bucket bounds as written (`le`), and the value of every series whose
value the requests decide (token counts, request counts, parameters, preemptions, the prompt tokens by source, the
tokens of all engine steps together: how requests share steps is each side's scheduling). Timings (TTFT, ITL, e2e
latency, the phases) are compared by their observation counts only, the block residency histograms by their form
(which blocks end when is each side's own), `vllm:cache_config_info` by its label names (ours among vLLM's: each side
states its own cache); what vLLM cannot export without a KV connector (the `vllm:nixl_*` families,
`vllm:num_requests_kv_fetch_by_stage`, and `vllm:external_prefix_cache_queries`, which a node counts as a connector
is always configured here) is listed apart.

Last line: JSON {"identical": n, "families": m, "differing": {family: [(series, ours, vllm), ...]}, "not_in_vllm":
[...], the model, CPU and date}.
"""

from __future__ import annotations

import datetime
import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agreement_servers import agreement_args, both_served, model_dir_of  # noqa: E402

from hybridpd.engine.dtype_choice import this_cpus_model  # noqa: E402

TIMINGS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
           "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
           "vllm:request_inference_time_seconds", "vllm:request_time_per_output_token_seconds")
CONNECTOR_ONLY = ("vllm:external_prefix_cache_queries",)   # vLLM counts it only with a KV connector configured
# which blocks are followed and when their memory is reused is each side's own: their form only
RESIDENCY = ("vllm:kv_block_lifetime_seconds", "vllm:kv_block_idle_before_evict_seconds",
             "vllm:kv_block_reuse_gap_seconds")
SERVER_LABELS = ("model_name", "engine")
STEPS = "vllm:iteration_tokens_total"   # how requests share steps is each side's scheduling: its sum only
INFO = "vllm:cache_config_info"   # each side's own cache: its labels only (ours a subset of vLLM's)
KV_CACHE_METRICS = ["--kv-cache-metrics", "--kv-cache-metrics-sample", "1"]


def complete(url: str, body: dict[str, Any]) -> None:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        json.load(response)


def families(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as response:
        return {family.name: family for family in text_string_to_metric_families(response.read().decode())}


def view(family: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, its labels but the server's): value}, without `_created` (a timestamp)."""
    return {(sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k not in SERVER_LABELS))):
            sample.value for sample in family.samples if not sample.name.endswith("_created")}


def compared(name: str, ours: Any, theirs: Any) -> list[tuple[str, Any, Any]]:
    """What differs between one family on both sides: its type, its series (labels, histogram bounds) and the values
    the requests decide (a timing's observation counts only; the cache's configuration: that each label of ours is
    one of vLLM's)."""
    if ours.type != theirs.type:
        return [("type", ours.type, theirs.type)]
    if name == INFO:
        mine, vllm = set(ours.samples[0].labels), set(theirs.samples[0].labels)
        return [("labels", sorted(mine - vllm), None)] if mine - vllm else []
    mine, vllm = view(ours), view(theirs)
    out = [(f"{sample}{dict(labels)}", "present" if (sample, labels) in mine else None,
            "present" if (sample, labels) in vllm else None) for sample, labels in sorted(set(mine) ^ set(vllm))]
    for key in sorted(set(mine) & set(vllm)):
        sample, labels = key
        timing_value = name in TIMINGS and not sample.endswith("_count")
        scheduled_value = name == STEPS and not sample.endswith("_sum")
        if not (timing_value or scheduled_value) and name not in RESIDENCY and mine[key] != vllm[key]:
            out.append((f"{sample}{dict(labels)}", mine[key], vllm[key]))
    return out


def main() -> None:
    args = agreement_args(__doc__, 4, "greedy prompts (one more with n = 2)")
    model_dir = model_dir_of(args.preset)
    with both_served(model_dir, args.venv, KV_CACHE_METRICS,
                     ["--no-enable-prefix-caching", "--skip-tokenizer-init", *KV_CACHE_METRICS]) as sides:
        for url, model in sides.values():
            for i in range(args.prompts):
                complete(url, {"model": model, "prompt": [5 + i, 9, 11, 13] * (i + 2), "max_tokens": 5,
                               "temperature": 0, "ignore_eos": True})
            complete(url, {"model": model, "prompt": [3, 4, 5, 6, 7], "max_tokens": 3, "temperature": 1.0,
                           "seed": 3, "ignore_eos": True, "n": 2})
        scraped = {side: families(url) for side, (url, _) in sides.items()}
    ours = {name for name in scraped["ours"] if name.startswith("vllm:")}
    differing, not_in_vllm = {}, []
    for name in sorted(ours):
        if name not in scraped["vllm"]:
            not_in_vllm.append(name)
            continue
        if name in CONNECTOR_ONLY:
            continue
        found = compared(name, scraped["ours"][name], scraped["vllm"][name])
        if found:
            differing[name] = found
            print(f"{name}: {found[:4]}", file=sys.stderr)
    checked = len(ours) - len(not_in_vllm) - len(CONNECTOR_ONLY)
    print(json.dumps({"identical": checked - len(differing), "families": checked, "differing": differing,
                      "not_in_vllm": not_in_vllm, "connector_only": list(CONNECTOR_ONLY), "model": str(model_dir),
                      "cpu": this_cpus_model(), "date": datetime.date.today().isoformat()}))


if __name__ == "__main__":
    main()
