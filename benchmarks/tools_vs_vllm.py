"""Tool calling against vLLM's CPU build: the same greedy chat requests with tools to both, compared field by field.

Not a speed figure: an agreement check against what vLLM itself answers. Both serve `--preset`'s checkpoint in
float32 with its tokenizer and chat template (Granite 4.0's format, tools included), vLLM from the venv `vs_vllm.py`
builds, started with `--enable-auto-tool-choice --tool-call-parser granite4` and its `guidance` structured-output
backend (llguidance, as ours), ours as `hybridpd serve DIR --threads 1 --dtype float32` with the same two tool flags.
Each case is asked with `--prompts` conversations, greedy, 64 tokens:

- `named`: `tool_choice` naming a tool (the output constrained to its parameters);
- `required`: `tool_choice: "required"` (a JSON list of calls of any of the tools);
- `auto_call`: `tool_choice: "auto"` with a regex in `structured_outputs` that makes the random model write a
  `<tool_call>` (the granite4 parser reads it);
- `auto_text`: `tool_choice: "auto"` alone (the random model writes text, no call).

Compared: the prompt's token ids (the chat template given the tools), the output's token ids, and the answer a client
reads (content, each call's name and arguments, the finish reason; call ids are random on both sides).

Last line: JSON {"identical": n, "requests": m, "per_case": {case: identical}, "prompts_identical": k, the model,
CPU and date}.
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
from agreement_servers import agreement_args, tools_served  # noqa: E402

from hybridpd.engine.dtype_choice import this_cpus_model  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add", "description": "Adds two integers", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["a", "b"]}}},
]
CALL_REGEX = r'<tool_call>\n\{"name": "add", "arguments": \{"a": [0-9]{1,2}, "b": [0-9]{1,2}\}\}\n</tool_call>'
CASES: dict[str, dict[str, Any]] = {
    "named": {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "required": {"tool_choice": "required"},
    "auto_call": {"tool_choice": "auto", "structured_outputs": {"regex": CALL_REGEX}},
    "auto_text": {"tool_choice": "auto"},
}
QUESTIONS = ["What is the weather in Zürich?", "Add 12 and 30.", "Tell me something about caches.",
             "Weather in Paris, in fahrenheit please.", "What is 7 plus 8?", "Say hello."]


def ask(url: str, model: str, question: str, case: dict[str, Any]) -> dict[str, Any] | str:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "tools": TOOLS, "max_tokens": 64,
            "temperature": 0.0, "return_token_ids": True, **case}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            return json.load(answer)
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.read()[:300].decode(errors='replace')}"


def client_view(answer: dict[str, Any] | str) -> Any:
    """What a client reads of an answer: content, calls (name, arguments) and the finish reason."""
    if isinstance(answer, str):
        return answer
    choice = answer["choices"][0]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls") or []]
    return {"content": choice["message"]["content"], "calls": calls, "finish_reason": choice["finish_reason"]}


def token_ids(answer: dict[str, Any] | str) -> tuple[Any, Any]:
    if isinstance(answer, str):
        return None, None
    return answer.get("prompt_token_ids"), answer["choices"][0].get("token_ids")


def main() -> int:
    args = agreement_args(__doc__, len(QUESTIONS), "conversations per case")
    with tools_served(args) as sides:
        per_case: dict[str, int] = {}
        prompts_identical = 0
        for name, case in CASES.items():
            per_case[name] = 0
            for question in QUESTIONS[:args.prompts]:
                answers = {side: ask(url, model, question, case) for side, (url, model) in sides.items()}
                ids = {side: token_ids(answer) for side, answer in answers.items()}
                views = {side: client_view(answer) for side, answer in answers.items()}
                prompts_identical += ids["ours"][0] is not None and ids["ours"][0] == ids["vllm"][0]
                per_case[name] += ids["ours"] == ids["vllm"] and views["ours"] == views["vllm"]
                print(f"{name} {question!r}: {views} outputs {'==' if ids['ours'][1] == ids['vllm'][1] else '!='}",
                      file=sys.stderr, flush=True)
    print(json.dumps({"identical": sum(per_case.values()), "requests": args.prompts * len(CASES),
                      "per_case": per_case, "prompts_identical": prompts_identical, "model": args.preset,
                      "cpu": this_cpus_model(), "date": datetime.date.today().isoformat()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
