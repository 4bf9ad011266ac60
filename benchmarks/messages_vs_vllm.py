"""Anthropic's Messages API against vLLM's CPU build: the same greedy `/v1/messages` requests to both, compared as a
client reads them, and `/v1/messages/count_tokens` for each.

Not a speed figure: an agreement check against what vLLM itself answers. Both serve `--preset`'s checkpoint in
float32 with its tokenizer and chat template (agreement_servers.py: vLLM with `--enable-auto-tool-choice
--tool-call-parser granite4` and its `guidance` backend, ours with the same two tool flags). Each case is asked with
`--prompts` questions, greedy, whole and streamed:

- `text`: a system prompt and a question, cut by `max_tokens` (`stop_reason` `max_tokens`);
- `blocks`: the system prompt as text blocks (one of them Claude Code's billing line, which both leave out) and the
  question as text blocks;
- `history`: a user's turn, an assistant's text and `tool_use`, the user's `tool_result` and a new question, the tools
  shown, `tool_choice` `none`;
- `named`: `tool_choice` `{"type": "tool"}` (the output constrained to the tool's input schema);
- `any`: `tool_choice` `{"type": "any"}` (chat's "required");
- `auto`: the tools with the default choice (the parser reads whatever the model writes);
- `stop`: `stop_sequences` that a short answer meets (`stop_reason` `stop_sequence` and the sequence);
- `json`: `output_config.format` a JSON schema.

Compared: what a client reads of the whole answer (each content block's type and text, or name and input; the stop
reason and sequence; the prompt's tokens, cache reads included, and the output tokens), of the stream (the kinds of its events in order, runs of deltas
counted as one; the blocks its deltas build; the final `message_delta`'s stop reason, sequence and output tokens),
and the `input_tokens` count_tokens gives for the same conversation. Message and tool-use ids are random on both
sides.

Last line: JSON {"identical": n, "requests": m, "per_case": {case: identical}, "streams_identical": k,
"counts_identical": c, the model, CPU and date}.
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
    {"name": "get_weather", "description": "The weather in a city", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}},
    {"name": "add", "description": "Adds two integers", "input_schema": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["a", "b"]}},
]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}}, "required": ["answer"]}
QUESTIONS = ["What is the weather in Zürich?", "Add 12 and 30.", "Tell me something about caches.",
             "Weather in Paris, in fahrenheit please.", "What is 7 plus 8?", "Say hello."]
BILLING = "x-anthropic-billing-header: cc_version=2.1.0; cc_entrypoint=cli; cch=4f2a9;"


def _user(question: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": question}]


def _history(question: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "Add 2 and 3."},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me add them."}, {
                "type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 3}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"},
                                         {"type": "text", "text": question}]}]


CASES: dict[str, Any] = {
    "text": lambda q: {"system": "Answer in one sentence.", "messages": _user(q), "max_tokens": 12},
    "blocks": lambda q: {"system": [{"type": "text", "text": BILLING}, {"type": "text", "text": "Be brief. "},
                                    {"type": "text", "text": "Be kind."}],
                         "messages": [{"role": "user", "content": [{"type": "text", "text": q},
                                                                   {"type": "text", "text": "Thanks."}]}]},
    "history": lambda q: {"messages": _history(q), "tools": TOOLS, "tool_choice": {"type": "none"}},
    "named": lambda q: {"messages": _user(q), "tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"},
                        "max_tokens": 400},
    "any": lambda q: {"messages": _user(q), "tools": TOOLS, "tool_choice": {"type": "any"}, "max_tokens": 400},
    "auto": lambda q: {"messages": _user(q), "tools": TOOLS},
    "stop": lambda q: {"messages": _user(q), "stop_sequences": ["e", "a"]},
    "json": lambda q: {"messages": _user(q), "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
}


def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, str]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()[:300].decode(errors="replace")


def ask(url: str, model: str, body: dict[str, Any], stream: bool) -> Any:
    status, raw = post(url, "/v1/messages", {"model": model, "max_tokens": 48, "temperature": 0.0, **body,
                                             "stream": stream})
    if status != 200:
        return f"HTTP {status}: {raw}"
    if not stream:
        return json.loads(raw)
    return [json.loads(line[len("data: "):]) for line in raw.splitlines() if line.startswith("data: ")]


def _block(block: dict[str, Any]) -> tuple[Any, ...]:
    return (("text", block["text"]) if block["type"] == "text"
            else (block["type"], block.get("name"), block.get("input")))


def _prompt_tokens(usage: dict[str, Any]) -> int | None:
    """The prompt's tokens: Anthropic's `input_tokens` leave out those read from the prefix cache (vLLM's side runs
    without one)."""
    if usage.get("input_tokens") is None:
        return None
    return usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0)


def client_view(message: dict[str, Any]) -> dict[str, Any]:
    usage = message.get("usage") or {}
    return {"content": [_block(block) for block in message["content"]], "stop_reason": message.get("stop_reason"),
            "stop_sequence": message.get("stop_sequence"),
            "tokens": (_prompt_tokens(usage), usage.get("output_tokens"))}


def stream_view(events: list[dict[str, Any]] | str) -> Any:
    if isinstance(events, str):
        return events
    blocks: dict[int, list[Any]] = {}
    for event in events:
        if event["type"] == "content_block_start":
            block = event["content_block"]
            blocks[event["index"]] = ["text", ""] if block["type"] == "text" else [block["type"], block["name"], ""]
        elif event["type"] == "content_block_delta":
            delta = event["delta"]
            blocks[event["index"]][-1] += delta.get("text", delta.get("partial_json", ""))
    built = [tuple(b) for _, b in sorted(blocks.items())]   # a tool_use block's input as its partial JSON came
    last = next((e for e in reversed(events) if e["type"] == "message_delta"), None)
    end = None if last is None else (last["delta"].get("stop_reason"), last["delta"].get("stop_sequence"),
                                     last["usage"].get("output_tokens"))
    return {"events": [kind for kind, _ in groupby(event["type"] for event in events)], "blocks": built, "end": end}


def counted(url: str, model: str, body: dict[str, Any]) -> Any:
    keys = ("system", "messages", "tools", "tool_choice")
    status, raw = post(url, "/v1/messages/count_tokens", {"model": model, **{k: body[k] for k in keys if k in body}})
    return json.loads(raw)["input_tokens"] if status == 200 else f"HTTP {status}: {raw}"


def main() -> int:
    args = agreement_args(__doc__, len(QUESTIONS), "questions per case")
    with tools_served(args) as sides:
        per_case: dict[str, int] = {}
        streams_identical = counts_identical = 0
        for name, case in CASES.items():
            per_case[name] = 0
            for question in QUESTIONS[:args.prompts]:
                body = case(question)
                whole = {side: ask(url, model, body, False) for side, (url, model) in sides.items()}
                views = {side: a if isinstance(a, str) else client_view(a) for side, a in whole.items()}
                streams = {side: stream_view(ask(url, model, body, True)) for side, (url, model) in sides.items()}
                counts = {side: counted(url, model, body) for side, (url, model) in sides.items()}
                per_case[name] += views["ours"] == views["vllm"]
                streams_identical += streams["ours"] == streams["vllm"]
                counts_identical += counts["ours"] == counts["vllm"]
                print(f"{name} {question!r}: {views}", file=sys.stderr, flush=True)
                for what, pair in (("streams", streams), ("counts", counts)):
                    if pair["ours"] != pair["vllm"]:
                        print(f"  {what} differ: {pair}", file=sys.stderr, flush=True)
    print(json.dumps({"identical": sum(per_case.values()), "requests": args.prompts * len(CASES),
                      "per_case": per_case, "streams_identical": streams_identical,
                      "counts_identical": counts_identical, "model": args.preset, "cpu": this_cpus_model(),
                      "date": datetime.date.today().isoformat()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
