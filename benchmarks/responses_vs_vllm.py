"""The Responses API against vLLM's CPU build: the same greedy `/v1/responses` requests to both, compared as a client
reads them.

Not a speed figure: an agreement check against what vLLM itself answers. Both serve `--preset`'s checkpoint in
float32 with its tokenizer and chat template, vLLM from the venv `vs_vllm.py` builds, started with
`--enable-auto-tool-choice --tool-call-parser granite4` and its `guidance` structured-output backend, ours as
`hybridpd serve DIR --threads 1 --dtype float32` with the same two tool flags. Each case is asked with `--prompts`
inputs, greedy, whole and streamed:

- `text`: a string input under `instructions`, cut by `max_output_tokens` (status `incomplete`);
- `history`: a list of items (a user message, an assistant's `function_call`, its `function_call_output`, a new
  user message), the tools shown, `tool_choice: "none"`;
- `named`: `tool_choice` naming a tool (the output constrained to its parameters);
- `auto_call`: `tool_choice: "auto"` with a regex in `structured_outputs` that makes the random model write a
  `<tool_call>` (the granite4 parser reads it);
- `json_schema`: `text.format` a JSON schema;
- `continued`: the last input item an assistant message with `status: "incomplete"`, which both continue (chat's
  `continue_final_message`) instead of answering it.

Compared: what a client reads of the whole answer (status, `incomplete_details`, each output item's type and text,
or name and arguments; the usage's input and output tokens), and of the stream (the completed response's same view,
and the kinds of its events in order, runs of deltas counted as one). Item and call ids are random on both sides.

Last line: JSON {"identical": n, "requests": m, "per_case": {case: identical}, "streams_identical": k, the model, CPU
and date}.
"""

from __future__ import annotations

import datetime
import json
import sys
import urllib.error
import urllib.request
from itertools import groupby
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agreement_servers import agreement_args, tools_served  # noqa: E402

from hybridpd.engine.dtype_choice import this_cpus_model  # noqa: E402

TOOLS = [
    {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}},
    {"type": "function", "name": "add", "description": "Adds two integers", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["a", "b"]}},
]
CALL_REGEX = r'<tool_call>\n\{"name": "add", "arguments": \{"a": [0-9]{1,2}, "b": [0-9]{1,2}\}\}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}}, "required": ["answer"]}
QUESTIONS = ["What is the weather in Zürich?", "Add 12 and 30.", "Tell me something about caches.",
             "Weather in Paris, in fahrenheit please.", "What is 7 plus 8?", "Say hello."]


def _history(question: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "Add 2 and 3."},
            {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "5"},
            {"role": "user", "content": [{"type": "input_text", "text": question}]}]


CASES: dict[str, Any] = {
    "text": lambda q: {"input": q, "instructions": "Answer in one sentence.", "max_output_tokens": 12},
    "history": lambda q: {"input": _history(q), "tools": TOOLS, "tool_choice": "none"},
    "named": lambda q: {"input": q, "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"}},
    "auto_call": lambda q: {"input": q, "tools": TOOLS, "structured_outputs": {"regex": CALL_REGEX},
                            "max_output_tokens": 96},
    "json_schema": lambda q: {"input": q, "text": {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}}},
    "continued": lambda q: {"input": [{"role": "user", "content": q}, {
        "type": "message", "role": "assistant", "status": "incomplete",
        "content": [{"type": "output_text", "text": "Well, the answer is"}]}], "max_output_tokens": 12},
}


def ask(url: str, model: str, body: dict[str, Any], stream: bool) -> Any:
    body = {"model": model, "max_output_tokens": 48, "temperature": 0.0, **body, "stream": stream}
    request = urllib.request.Request(url + "/v1/responses", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            raw = answer.read().decode()
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.read()[:300].decode(errors='replace')}"
    if not stream:
        return json.loads(raw)
    return [json.loads(line[len("data: "):]) for line in raw.splitlines() if line.startswith("data: ")]


def client_view(response: dict[str, Any]) -> dict[str, Any]:
    items = []
    for item in response["output"]:
        if item["type"] == "message":
            items.append(("message", [part["text"] for part in item["content"]]))
        else:
            items.append((item["type"], item.get("name"), item.get("arguments")))
    usage = response.get("usage") or {}
    return {"status": response["status"], "incomplete_details": response.get("incomplete_details"), "output": items,
            "tokens": (usage.get("input_tokens"), usage.get("output_tokens"))}


def stream_view(events: list[dict[str, Any]] | str) -> Any:
    if isinstance(events, str):
        return events
    kinds = [kind for kind, _ in groupby(event["type"] for event in events)]
    return {"events": kinds, "completed": client_view(events[-1]["response"]) if events else None}


def main() -> int:
    args = agreement_args(__doc__, len(QUESTIONS), "inputs per case")
    with tools_served(args) as sides:
        per_case: dict[str, int] = {}
        streams_identical = 0
        for name, case in CASES.items():
            per_case[name] = 0
            for question in QUESTIONS[:args.prompts]:
                body = case(question)
                whole = {side: ask(url, model, body, False) for side, (url, model) in sides.items()}
                views = {side: a if isinstance(a, str) else client_view(a) for side, a in whole.items()}
                streams = {side: stream_view(ask(url, model, body, True)) for side, (url, model) in sides.items()}
                per_case[name] += views["ours"] == views["vllm"]
                streams_identical += streams["ours"] == streams["vllm"]
                print(f"{name} {question!r}: {views}", file=sys.stderr, flush=True)
                if streams["ours"] != streams["vllm"]:
                    print(f"  streams differ: {streams}", file=sys.stderr, flush=True)
    print(json.dumps({"identical": sum(per_case.values()), "requests": args.prompts * len(CASES),
                      "per_case": per_case, "streams_identical": streams_identical, "model": args.preset,
                      "cpu": this_cpus_model(), "date": datetime.date.today().isoformat()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
