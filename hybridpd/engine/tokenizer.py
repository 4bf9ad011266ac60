"""Tokenizers: the checkpoint's `tokenizer.json` (via `tokenizers`) when it has one, else a byte tokenizer; none at
all with `--skip-tokenizer-init` (vLLM's flag: `TokenIdsOnly`).

Byte tokenizer: ids 0..255 are the UTF-8 bytes; the checkpoint's `eos_token_id` (default 256) and
`bos_token_id` (default 257) are special; any id >= 256 decodes to nothing. `encode` adds no special tokens.
Chat: the checkpoint's `chat_template` (tokenizer_config.json or chat_template.jinja) rendered with jinja2,
else the plain template `"<role>: <content>\\n" ... + "assistant: "`.
`describe()` is what vLLM's `/tokenizer_info` answers: tokenizer_config.json's fields, `tokenizer_class`, and the
chat template in use.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from hybridpd.errors import InvalidRequestError

BYTE_VOCAB = 256
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
# What a template is rendered with by us; a request's chat_template_kwargs may not set these.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "documents",
                                         *SPECIAL_TOKEN_NAMES})


class Tokenizer(Protocol):
    eos_token_id: int | None
    vocab_size: int
    decodes_text: bool  # False: outputs carry token ids and no text (TokenIdsOnly)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id's token as the vocabulary writes it (transformers' `convert_ids_to_tokens`)."""

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            template_kwargs: Mapping[str, Any] | None = None,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as the chat template renders it; `template_kwargs` are more variables for the template
        (vLLM's `chat_template_kwargs`, such as a template's `thinking` switch); `tools` the tools it may show the
        model (OpenAI's `{"type": "function", "function": {...}}` objects, as transformers passes them)."""

    def with_chat_template(self, source: str) -> Tokenizer:
        """This tokenizer rendering chat with the jinja2 template `source` instead of its own (a server's
        `--chat-template`, or a request's own template where the server trusts it); a bad template is an
        InvalidRequestError naming `chat_template`."""

    def describe(self) -> dict[str, Any]: ...


def message_text(message: Any) -> tuple[str, str]:
    """(role, content) of one OpenAI chat message; content may be a string or a list of text parts."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InvalidRequestError("each message must be an object with a string 'role'", "messages")
    content = message.get("content")
    if content is None:
        content = ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError("only text content parts are supported", "messages")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise InvalidRequestError("message 'content' must be a string or a list of text parts", "messages")
    return message["role"], content


def plain_chat_template(messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None) -> str:
    """`role: content` lines, for a tokenizer without a chat template; tools, when given, on a first `tools:` line
    (their JSON), an assistant's calls after its content as `<tool_call>` JSON (the `granite4` parser's format)."""
    lines = [f"tools: {json.dumps(tools, ensure_ascii=False)}\n"] if tools else []
    for message, (role, content) in zip(messages, map(message_text, messages)):
        calls = "".join(f"<tool_call>{json.dumps(call['function'], ensure_ascii=False)}</tool_call>"
                        for call in message.get("tool_calls") or ())
        lines.append(f"{role}: {content}{calls}\n")
    return "".join(lines) + ("assistant: " if add_generation_prompt else "")


class ChatTemplate:
    """A Hugging Face jinja2 chat template, rendered in a sandbox (with `add_generation_prompt` unless told not)."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        self.source = source
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = self._raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda value, indent=None, ensure_ascii=False, sort_keys=False: json.dumps(
            value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
        self._template = env.from_string(source)
        self._special = special_tokens  # bos_token, eos_token, pad_token, unk_token: as transformers passes them

    @staticmethod
    def _raise(message: str) -> None:
        raise InvalidRequestError(f"chat template: {message}", "messages")

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               template_kwargs: Mapping[str, Any] | None = None, tools: list[dict[str, Any]] | None = None) -> str:
        from jinja2 import TemplateError

        normalized = [{**m, "role": role, "content": content} for m, (role, content) in
                      zip(messages, map(message_text, messages))]
        try:
            return self._template.render(
                **(template_kwargs or {}), messages=normalized, add_generation_prompt=add_generation_prompt,
                tools=tools, documents=None, **self._special
            )
        except TemplateError as exc:
            raise InvalidRequestError(f"chat template failed: {exc}", "messages") from exc


@functools.lru_cache(maxsize=16)
def compiled_template(source: str, special_tokens: tuple[tuple[str, str], ...]) -> ChatTemplate:
    """`source` compiled once (a server renders the same few templates again and again); a template jinja2 cannot
    parse is an InvalidRequestError naming `chat_template`."""
    from jinja2 import TemplateError

    try:
        return ChatTemplate(source, dict(special_tokens))
    except TemplateError as exc:
        raise InvalidRequestError(f"the chat template does not compile: {exc}", "chat_template") from exc


class ByteTokenizer:
    decodes_text = True
    _chat: ChatTemplate | None = None   # a template given to it (with_chat_template); else the plain one

    def __init__(self, vocab_size: int, eos_token_id: int | None = BYTE_VOCAB, bos_token_id: int | None = None) -> None:
        if vocab_size < BYTE_VOCAB:
            raise ValueError(f"a byte tokenizer needs vocab_size >= {BYTE_VOCAB}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id if eos_token_id is not None and eos_token_id < vocab_size else None
        self.bos_token_id = bos_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """A byte as its Latin-1 character; a special id as `<id>`."""
        return [bytes([i]).decode("latin-1") if 0 <= i < BYTE_VOCAB else f"<{i}>" for i in ids]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            template_kwargs: Mapping[str, Any] | None = None,
                            tools: list[dict[str, Any]] | None = None) -> str:
        if self._chat is None:
            return plain_chat_template(messages, add_generation_prompt, tools)
        return self._chat.render(messages, add_generation_prompt, template_kwargs, tools)

    def with_chat_template(self, source: str) -> ByteTokenizer:
        templated = copy.copy(self)
        templated._chat = compiled_template(source, ())
        return templated

    def describe(self) -> dict[str, Any]:
        return {"tokenizer_class": "ByteTokenizer", "vocab_size": self.vocab_size, "eos_token": None,
                "bos_token": None, "pad_token": None, "chat_template": self._chat.source if self._chat else None}


class HFTokenizer:
    """`tokenizers.Tokenizer` from tokenizer.json; `vocab_size` is the model's (ids the model can emit)."""

    decodes_text = True

    def __init__(
        self, path: Path, vocab_size: int, eos_token_id: int | None, chat_template: str | None,
        config: dict[str, Any] | None = None,
    ) -> None:
        """`chat_template`: the template's source (the checkpoint's), rendered with the config's special tokens."""
        from tokenizers import Tokenizer as RustTokenizer

        self._tok = RustTokenizer.from_file(str(path))
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._config = config or {}   # tokenizer_config.json
        # bos_token, eos_token, pad_token, unk_token as text: what a chat template is rendered with
        self.special_tokens = {name: _token_text(self._config.get(name)) or "" for name in SPECIAL_TOKEN_NAMES}
        self._chat = ChatTemplate(chat_template, self.special_tokens) if chat_template else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """As `AutoTokenizer(dir)(text)`: the tokenizer.json post-processor adds its special tokens (a BOS, say) unless
        `add_special_tokens=False` (a rendered chat template already holds them, as transformers and vLLM do)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def backend_json(self) -> str:
        """tokenizer.json's content as `tokenizers` holds it (what llguidance builds its vocabulary from)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        return [self._tok.id_to_token(i) or "" for i in ids]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            template_kwargs: Mapping[str, Any] | None = None,
                            tools: list[dict[str, Any]] | None = None) -> str:
        if self._chat is None:
            return plain_chat_template(messages, add_generation_prompt, tools)
        return self._chat.render(messages, add_generation_prompt, template_kwargs, tools)

    def with_chat_template(self, source: str) -> HFTokenizer:
        """The same tokenizer (its vocabulary shared, not loaded again) with another chat template."""
        templated = copy.copy(self)
        templated._chat = compiled_template(source, tuple(sorted(self.special_tokens.items())))
        return templated

    def describe(self) -> dict[str, Any]:
        """tokenizer_config.json with its special tokens as their text (transformers writes some as objects)."""
        info = {key: _token_text(value) if key in SPECIAL_TOKEN_NAMES else value
                for key, value in self._config.items() if key != "added_tokens_decoder"}
        info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        info["chat_template"] = self._chat.source if self._chat is not None else None
        return info


NO_TOKENIZER = "this node runs with --skip-tokenizer-init"


class TokenIdsOnly:
    """No tokenizer (`--skip-tokenizer-init`, as vLLM's): prompts must be token ids, outputs carry token ids and
    empty text. Text prompts, chat messages and stop strings need a tokenizer and are refused (HTTP 400); the end of
    sequence comes from config.json and generation_config.json only."""

    decodes_text = False
    eos_token_id = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise InvalidRequestError(f"{NO_TOKENIZER}: send the prompt as token ids, not text", "prompt")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        raise InvalidRequestError(f"{NO_TOKENIZER}: token strings need the tokenizer", "return_token_strs")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            template_kwargs: Mapping[str, Any] | None = None,
                            tools: list[dict[str, Any]] | None = None) -> str:
        raise InvalidRequestError(f"{NO_TOKENIZER}: chat messages need the tokenizer; use /v1/completions with token "
                                  "ids", "messages")

    def with_chat_template(self, source: str) -> TokenIdsOnly:
        return self   # chat is refused whatever the template

    def describe(self) -> dict[str, Any]:
        raise InvalidRequestError(f"{NO_TOKENIZER}: there is no tokenizer to describe")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text())
    return value if isinstance(value, dict) else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_source(model_dir: Path, tok_config: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def load_tokenizer(model_dir: Path, vocab_size: int, *, skip_init: bool = False,
                   chat_template: str | None = None) -> Tokenizer:
    """The checkpoint's tokenizer; `chat_template`, when given, replaces its chat template (vLLM's `--chat-template`:
    for a checkpoint without one, or to render another way)."""
    tokenizer = _checkpoint_tokenizer(model_dir, vocab_size, skip_init)
    return tokenizer if chat_template is None else tokenizer.with_chat_template(chat_template)


def _checkpoint_tokenizer(model_dir: Path, vocab_size: int, skip_init: bool) -> Tokenizer:
    if skip_init:
        return TokenIdsOnly(vocab_size)
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json")
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        return ByteTokenizer(
            vocab_size,
            eos_token_id=BYTE_VOCAB if eos is None else eos,
            bos_token_id=config.get("bos_token_id"),
        )
    tok_config = _read_json(model_dir / "tokenizer_config.json")
    tokenizer = HFTokenizer(tokenizer_file, vocab_size, eos, _template_source(model_dir, tok_config), tok_config)
    eos_text = tokenizer.special_tokens["eos_token"]
    if eos is None and eos_text:
        tokenizer.eos_token_id = tokenizer.token_to_id(eos_text)
    return tokenizer
