"""Request rules against vLLM's CPU build: the same requests to both, on the rules vLLM sets for a request's length
and its final message, compared as a client reads the answers.

Not a speed figure: an agreement check. Both serve `--preset`'s checkpoint in float32 with `--max-model-len 256`
(vLLM from the venv `vs_vllm.py` builds). Greedy requests:

- lengths: chat without a length (the rest of the context), chat and Responses asking for more than the prompt
  leaves (cut) or more than the context (refused), completions whose prompt leaves less than asked for or than the
  default 16 (cut), a prompt cut by `truncate_prompt_tokens`, a prompt that fills the context and one beyond it
  (refused);
- the final message: `continue_final_message` (the prompt ends inside the assistant's message) with and without
  chat's `echo`, and `echo` after a user's message and after an assistant's, whole and streamed;
- `stream_options.continuous_usage_stats`: the usage so far in every chunk, a completion and a continued, echoed chat.

Compared: the HTTP status; for an answer, its finish reason (or Responses status) and the prompt and output token
counts, and the message's text (whole) or the first four deltas and every chunk's output count (streamed); for a
refusal, the `param` it names. Messages are not compared (vLLM appends `(parameter=..., value=...)`).

Last line: JSON {"identical": n, "requests": m, "differing": [case...], the model, CPU and date}.
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
from agreement_servers import agreement_args, both_served, model_dir_of  # noqa: E402

from hybridpd.engine.dtype_choice import this_cpus_model  # noqa: E402

CONTEXT = 256
MESSAGES = [{"role": "user", "content": "Tell me about caches."}]
IDS = list(range(3, 3 + CONTEXT + 44))
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat_without_length": ("/v1/chat/completions", {"messages": MESSAGES}),
    "chat_max_tokens_cut": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 250}),
    "chat_max_completion_tokens_cut": ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 250}),
    "chat_the_whole_context": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": CONTEXT}),
    "chat_past_the_context": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": CONTEXT + 44}),
    "completion_default_cut": ("/v1/completions", {"prompt": IDS[:250]}),
    "completion_max_tokens_cut": ("/v1/completions", {"prompt": IDS[:250], "max_tokens": 10, "ignore_eos": True}),
    "completion_truncated_prompt": ("/v1/completions", {"prompt": IDS, "truncate_prompt_tokens": 200,
                                                        "max_tokens": 100, "ignore_eos": True}),
    "completion_prompt_fills_context": ("/v1/completions", {"prompt": IDS[:CONTEXT], "max_tokens": 1}),
    "completion_prompt_past_context": ("/v1/completions", {"prompt": IDS, "max_tokens": 1}),
    "responses_cut": ("/v1/responses", {"input": "Tell me about caches.", "max_output_tokens": 250}),
    "responses_past_the_context": ("/v1/responses", {"input": "Tell me about caches.", "max_output_tokens": 300}),
}
CONTINUED = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
OPEN = {"add_generation_prompt": False, "continue_final_message": True}
FINAL_MESSAGE_CASES: dict[str, dict[str, Any]] = {
    "continued": {"messages": CONTINUED, **OPEN},
    "continued_echo": {"messages": CONTINUED, **OPEN, "echo": True},
    "echo_after_user": {"messages": CONTINUED[:1], "echo": True},
    "echo_after_assistant": {"messages": CONTINUED, "echo": True},
}
STREAMED = {"stream": True, "stream_options": {"include_usage": True}}
CASES |= {name + suffix: ("/v1/chat/completions", {**body, "max_tokens": 6, **extra})
          for name, body in FINAL_MESSAGE_CASES.items() for suffix, extra in (("", {}), ("_streamed", STREAMED))}
EVERY_CHUNK = {"stream": True, "max_tokens": 5, "ignore_eos": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
CASES |= {
    "completion_usage_in_every_chunk": ("/v1/completions", {"prompt": IDS[:20], **EVERY_CHUNK}),
    "chat_usage_in_every_chunk": ("/v1/chat/completions", {"messages": CONTINUED, **OPEN, "echo": True,
                                                           **EVERY_CHUNK}),
}


def ask(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(status, the JSON answer, or a stream's chunks)."""
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            raw = response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")
    if not body.get("stream"):
        return 200, json.loads(raw)
    return 200, [json.loads(line[6:]) for line in raw.splitlines()
                 if line.startswith("data: ") and line != "data: [DONE]"]


def client_view(status: int, answer: Any) -> dict[str, Any]:
    if status != 200:
        return {"status": status, "param": answer.get("error", {}).get("param")}
    if isinstance(answer, list):   # a stream: its first deltas (texts), the finish reason, the usage chunk's and
        # each chunk's output token counts
        choices = [chunk["choices"][0] for chunk in answer if chunk.get("choices")]
        usage = answer[-1].get("usage") or {}
        return {"status": status, "deltas": [c.get("delta", c.get("text")) for c in choices[:4]],
                "finish": choices[-1].get("finish_reason"), "prompt": usage.get("prompt_tokens"),
                "output": usage.get("completion_tokens"),
                "usage_per_chunk": [(chunk.get("usage") or {}).get("completion_tokens") for chunk in answer]}
    usage = answer.get("usage") or {}
    if answer.get("object") == "response":
        return {"status": status, "finish": answer.get("status"), "prompt": usage.get("input_tokens"),
                "output": usage.get("output_tokens")}
    choice = answer["choices"][0]
    return {"status": status, "finish": choice.get("finish_reason"), "prompt": usage.get("prompt_tokens"),
            "output": usage.get("completion_tokens"), **({"text": choice["message"]["content"]}
                                                         if "message" in choice else {})}


def main() -> int:
    args = agreement_args(__doc__, 1, "unused: every case is asked once")
    flags = ["--max-model-len", str(CONTEXT)]
    differing = []
    with both_served(model_dir_of(args.preset), args.venv, flags, flags) as sides:
        for name, (path, body) in CASES.items():
            views = {side: client_view(*ask(url, path, {**body, "model": model, "temperature": 0}))
                     for side, (url, model) in sides.items()}
            print(json.dumps({"case": name, **views}), flush=True)
            if views["ours"] != views["vllm"]:
                differing.append(name)
    print(json.dumps({"identical": len(CASES) - len(differing), "requests": len(CASES), "differing": differing,
                      "model": args.preset, "context": CONTEXT, "cpu": this_cpus_model(),
                      "date": datetime.date.today().isoformat()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
