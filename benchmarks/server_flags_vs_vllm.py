"""vLLM's server flags and service routes against vLLM's CPU build: both started with the same flags, the same
requests to both, compared as a client (or a browser, a load balancer, SageMaker) reads the answers.

Not a speed figure: an agreement check. Both serve `--preset`'s checkpoint in float32 (vLLM from the venv
`vs_vllm.py` builds) with `--chat-template FILE` (a template that shows a variable), `--default-chat-template-kwargs`,
`--response-role`, `--enable-force-include-usage`, `--enable-server-load-tracking`, `--enable-request-id-headers`,
`--sse-keep-alive-interval` and `--allowed-origins`. Greedy requests:

- the template: `/tokenize` of a conversation with the default variable and with the request's own; a chat answer's
  text, role and token counts; a request's own template (refused: not trusted);
- the answer's role with and without a generation prompt; a stream without `stream_options` (usage forced: which
  chunks carry it, the last usage);
- SageMaker's `/invocations` with a chat body, a completions body and a body for neither; `/ping` (GET, POST),
  `/version` (has one), `/load` (idle);
- `X-Request-Id` on answers (the request's own echoed, one made up otherwise);
- the model named by the directory both were given (vLLM's served name without `--served-model-name`), and by
  another name (refused: the status and the start of the error's message, the path not shown);
- CORS: preflights from the allowed origin and another, and a request from the allowed origin (the status and every
  `Access-Control-*` header).

Compared: statuses, and per case the fields named above (a usage by its three counts: ours always adds
`prompt_tokens_details`, vLLM's with `--enable-prompt-tokens-details`). Last line: JSON {"identical": n, "cases": m,
"differing": [case...], the model, CPU and date}.
"""

from __future__ import annotations

import datetime
import json
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agreement_servers import agreement_args, both_served, model_dir_of  # noqa: E402

from hybridpd.engine.dtype_choice import this_cpus_model  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|{{ tone }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SITE = "https://app.example"
USER = [{"role": "user", "content": "Tell me about caches."}]


def call(url: str, method: str, path: str, body: Any = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method,
                                     headers={**({"Content-Type": "application/json"} if data else {}),
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, dict(response.headers.items()), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers.items()), error.read()


def events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def chat_view(status: int, raw: bytes) -> dict[str, Any]:
    if status != 200:
        return {"status": status}
    answer = json.loads(raw)
    choice = answer["choices"][0]
    return {"status": status, "role": choice["message"]["role"], "text": choice["message"]["content"],
            "usage": [answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]]}


def cases(model: str, model_dir: str) -> dict[str, tuple[str, str, Any, dict[str, str], Any]]:
    """name -> (method, path, body, headers, what of the answer is compared: a function of (status, headers, raw));
    `model`: the side's served name, `model_dir`: the directory both serve, as given to both."""
    chat = {"model": model, "messages": USER, "max_tokens": 4, "temperature": 0}
    cors = ("access-control-allow-origin", "access-control-allow-methods", "access-control-allow-headers",
            "access-control-allow-credentials", "access-control-max-age")

    def cors_view(status, headers, raw):
        lower = {k.lower(): v for k, v in headers.items()}
        return {"status": status, **{k: lower.get(k) for k in cors}}

    def tokens(status, headers, raw):
        return {"status": status, "tokens": json.loads(raw).get("tokens") if status == 200 else None}

    def stream_usage(status, headers, raw):
        chunks = events(raw)
        last = (chunks[-1].get("usage") or {}) if chunks else {}
        return {"status": status, "usage_in": ["usage" in c and c["usage"] is not None for c in chunks],
                "last": [last.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens")],
                "roles": [c["choices"][0].get("delta", {}).get("role") for c in chunks if c.get("choices")][:1]}

    def object_kind(status, headers, raw):
        return {"status": status, "object": json.loads(raw).get("object") if status == 200 else None}

    def status_only(status, headers, raw):
        return {"status": status}

    def version(status, headers, raw):
        return {"status": status, "keys": sorted(json.loads(raw))}

    def json_body(status, headers, raw):
        return {"status": status, "body": json.loads(raw)}

    def request_id(status, headers, raw):
        given = {k.lower(): v for k, v in headers.items()}.get("x-request-id")
        return {"status": status, "echoed": given == "rid-1"}

    def error_start(status, headers, raw):   # the type is OpenAI's code here, vLLM's class name there
        return {"status": status, "starts": str((json.loads(raw).get("error") or {}).get("message"))[:28]}

    def made_id(status, headers, raw):
        return {"status": status, "has_id": bool({k.lower(): v for k, v in headers.items()}.get("x-request-id"))}

    return {
        "tokenize_default_variable": ("POST", "/tokenize", {"model": model, "messages": USER}, {}, tokens),
        "tokenize_request_variable": ("POST", "/tokenize", {"model": model, "messages": USER,
                                                            "chat_template_kwargs": {"tone": "loud"}}, {}, tokens),
        "chat_with_the_template": ("POST", "/v1/chat/completions", chat, {}, lambda s, h, r: chat_view(s, r)),
        "chat_without_generation_prompt": ("POST", "/v1/chat/completions", {**chat, "add_generation_prompt": False},
                                           {}, lambda s, h, r: chat_view(s, r)),
        "chat_own_template_untrusted": ("POST", "/v1/chat/completions", {**chat, "chat_template": "{{ 1 }}"}, {},
                                        status_only),
        "chat_stream_usage_forced": ("POST", "/v1/chat/completions", {**chat, "stream": True}, {}, stream_usage),
        "completion_stream_usage_forced": ("POST", "/v1/completions",
                                           {"model": model, "prompt": "Caches are", "max_tokens": 4,
                                            "temperature": 0, "stream": True}, {}, stream_usage),
        "invocations_chat": ("POST", "/invocations", chat, {}, object_kind),
        "invocations_completion": ("POST", "/invocations", {"model": model, "prompt": "Caches are",
                                                            "max_tokens": 4, "temperature": 0}, {}, object_kind),
        "invocations_neither": ("POST", "/invocations", {"model": model, "input": "x"}, {}, status_only),
        "completion_naming_the_model_dir": ("POST", "/v1/completions", {"model": model_dir, "prompt": "Caches are",
                                                                         "max_tokens": 4, "temperature": 0}, {},
                                            object_kind),
        "completion_naming_another_model": ("POST", "/v1/completions", {"model": f"{model_dir}-other",
                                                                         "prompt": "Caches are", "max_tokens": 4},
                                            {}, error_start),
        "ping_get": ("GET", "/ping", None, {}, status_only),
        "ping_post": ("POST", "/ping", None, {}, status_only),
        "version": ("GET", "/version", None, {}, version),
        "load_idle": ("GET", "/load", None, {}, json_body),
        "request_id_echoed": ("POST", "/v1/chat/completions", chat, {"X-Request-Id": "rid-1"}, request_id),
        "request_id_made": ("POST", "/v1/chat/completions", chat, {}, made_id),
        "cors_preflight_allowed": ("OPTIONS", "/v1/chat/completions", None,
                                   {"Origin": SITE, "Access-Control-Request-Method": "POST",
                                    "Access-Control-Request-Headers": "authorization, content-type"}, cors_view),
        "cors_preflight_other_origin": ("OPTIONS", "/v1/chat/completions", None,
                                        {"Origin": "https://elsewhere.example",
                                         "Access-Control-Request-Method": "POST"}, cors_view),
        "cors_simple_allowed": ("POST", "/v1/chat/completions", chat, {"Origin": SITE}, cors_view),
        "cors_simple_other_origin": ("POST", "/v1/chat/completions", chat, {"Origin": "https://elsewhere.example"},
                                     cors_view),
    }


def main() -> int:
    args = agreement_args(__doc__, 1, "unused: every case is asked once")
    template = Path(tempfile.mkdtemp()) / "chat.jinja"
    template.write_text(TEMPLATE)
    flags = ["--chat-template", str(template), "--default-chat-template-kwargs", '{"tone": "calm"}',
             "--response-role", "model", "--enable-force-include-usage", "--enable-server-load-tracking",
             "--enable-request-id-headers", "--sse-keep-alive-interval", "5", "--allowed-origins", f'["{SITE}"]']
    differing = []
    model_dir = model_dir_of(args.preset)
    with both_served(model_dir, args.venv, flags, flags) as sides:
        names = list(cases("", ""))
        for name in names:
            views = {}
            for side, (url, model) in sides.items():
                method, path, body, headers, view = cases(model, str(model_dir))[name]
                views[side] = view(*call(url, method, path, body, headers))
            print(json.dumps({"case": name, **views}), flush=True)
            if views["ours"] != views["vllm"]:
                differing.append(name)
    print(json.dumps({"identical": len(names) - len(differing), "cases": len(names), "differing": differing,
                      "model": args.preset, "cpu": this_cpus_model(), "date": datetime.date.today().isoformat()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
