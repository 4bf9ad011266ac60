"""Which chat template renders a request, as vLLM's flags decide it.

- `--chat-template`: a file's path, or the template itself in one line, replacing the checkpoint's (for a
  checkpoint that has none, or to render it another way). As vLLM reads the flag: a path that opens is read; a
  value with none of `{`, `}` or a newline that does not open is a path that failed (an error at start-up); else the
  value is the template.
- A request's own template (`chat_template`, or `chat_template_kwargs.chat_template`) is used only under
  `--trust-request-chat-template`; without it such a request is refused with vLLM's message, as a template runs on
  the server.
- `--default-chat-template-kwargs`: variables every request's template sees unless its own `chat_template_kwargs`
  set them (`{"enable_thinking": false}`, say).
- `--response-role`: the role a chat answer carries when the template's generation prompt opened the turn (the
  default, `add_generation_prompt` true); without one the answer continues the last turn and carries its role.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridpd.engine.tokenizer import RESERVED_TEMPLATE_VARIABLES, Tokenizer, compiled_template
from hybridpd.errors import InvalidRequestError

UNTRUSTED = ("Chat template is passed with request, but --trust-request-chat-template is not set. Refused request "
             "with untrusted chat template.")
_JINJA_CHARACTERS = "{}\n"


@dataclass(frozen=True)
class ChatTemplating:
    trust_request_template: bool = False
    default_kwargs: tuple[tuple[str, Any], ...] = ()   # (name, JSON value) pairs
    response_role: str = "assistant"

    def __post_init__(self) -> None:
        taken = sorted((RESERVED_TEMPLATE_VARIABLES | {"chat_template"}) & {name for name, _ in self.default_kwargs})
        if taken:
            raise ValueError(f"--default-chat-template-kwargs may not set {', '.join(taken)}")
        if not self.response_role:
            raise ValueError("--response-role must not be empty")

    def kwargs(self, asked: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """The template's variables: the defaults, then the request's own over them."""
        if not self.default_kwargs:
            return None if asked is None else dict(asked)
        return {**dict(self.default_kwargs), **(asked or {})}

    def tokenizer_for(self, tokenizer: Tokenizer, asked: str | None) -> Tokenizer:
        """The tokenizer that renders a request that sent the template `asked` (None: the server's own)."""
        if asked is None:
            return tokenizer
        if not self.trust_request_template:
            raise InvalidRequestError(UNTRUSTED, "chat_template")
        return tokenizer.with_chat_template(asked)


def template_argument(value: str | None) -> str | None:
    """`--chat-template`'s value as the template's source (a file read, or the value itself); ValueError when it
    names a file that does not open, or holds a template that does not compile."""
    if value is None:
        return None
    try:
        source = Path(value).read_text()
    except (OSError, ValueError) as exc:
        if not any(c in value for c in _JINJA_CHARACTERS):
            raise ValueError(f"--chat-template {value!r} looks like a file's path, but it does not open: {exc}") \
                from exc
        source = value
    try:
        compiled_template(source, ())
    except InvalidRequestError as exc:
        raise ValueError(f"--chat-template: {exc}") from exc
    return source


def default_kwargs_argument(value: str | None) -> tuple[tuple[str, Any], ...]:
    """`--default-chat-template-kwargs`' JSON object as its (name, value) pairs; ValueError when it is not one."""
    if value is None:
        return ()
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"--default-chat-template-kwargs is not JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise ValueError("--default-chat-template-kwargs must be a JSON object, such as '{\"enable_thinking\": false}'")
    return tuple(parsed.items())
