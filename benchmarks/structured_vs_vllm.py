"""Structured outputs against vLLM's CPU build: the same greedy constrained requests to both, token ids compared.

Not a speed figure: an agreement check against what vLLM itself produces (its `guidance` backend, llguidance, which
ours uses too). Both serve `--preset`'s checkpoint in float32 with its tokenizer (structured outputs need one); vLLM
from the venv `vs_vllm.py` builds, started with `--structured-outputs-config.backend guidance` and
`--structured-outputs-config.disable_any_whitespace true` (its guidance backend reads that switch from the server's
config, not from the request), ours as `hybridpd serve DIR --threads 1 --dtype float32`. Each constraint kind (a
choice, a regex, a Lark grammar, a JSON schema, any JSON object; the JSON ones with `disable_any_whitespace` in the
request, so that both sides apply the same rule) is asked with `--prompts` token-id prompts, greedy, 48 tokens.

Last line: JSON {"identical": n, "requests": m, "per_kind": {kind: identical}, the model, CPU and date}.
"""

from __future__ import annotations

import datetime
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agreement_servers import GUIDANCE, agreement_args, both_served, model_dir_of  # noqa: E402

from hybridpd.engine.dtype_choice import this_cpus_model  # noqa: E402

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
          "required": ["name", "n", "ok", "tags"], "additionalProperties": False}
CONSTRAINTS: dict[str, dict[str, Any]] = {
    "choice": {"choice": ["prefill", "decode", "both", "neither"]},
    "regex": {"regex": "[A-Z][a-z]{2,6} [0-9]{1,3}"},
    "grammar": {"grammar": 'start: "x=" NUM ("+" NUM)*\nNUM: /[0-9]{1,2}/'},
    "json_schema": {"json": SCHEMA, "disable_any_whitespace": True},
    "json_object": {"json_object": True, "disable_any_whitespace": True},
}


def constrained_ids(url: str, model: str, prompt: list[int], structured: dict[str, Any]) -> list[int] | str:
    body = {"model": model, "prompt": prompt, "max_tokens": 48, "temperature": 0.0, "return_token_ids": True,
            "structured_outputs": structured}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            return list(json.load(answer)["choices"][0]["token_ids"])
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.read()[:200].decode(errors='replace')}"


def main() -> int:
    args = agreement_args(__doc__, 6, "prompts per constraint kind")
    flags = [*GUIDANCE, "--structured-outputs-config.disable_any_whitespace", "true"]
    with both_served(model_dir_of(args.preset), args.venv, flags, []) as sides:
        per_kind: dict[str, int] = {}
        for kind, structured in CONSTRAINTS.items():
            per_kind[kind] = 0
            for k in range(args.prompts):
                prompt = [(17 * k + 31 * i) % 200 + 3 for i in range(24 + 8 * k)]
                answers = {side: constrained_ids(url, model, prompt, structured)
                           for side, (url, model) in sides.items()}
                per_kind[kind] += answers["ours"] == answers["vllm"]
                print(f"{kind} {k}: {answers}", file=sys.stderr, flush=True)
    print(json.dumps({"identical": sum(per_kind.values()), "requests": args.prompts * len(CONSTRAINTS),
                      "per_kind": per_kind, "model": args.preset, "cpu": this_cpus_model(),
                      "date": datetime.date.today().isoformat()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
