"""The shapes a completions body's `prompt` takes (OpenAI's API, vLLM): a string, a list of token ids, or a list of
those. The node parses it (server/protocol.py) and the proxy routes by it (proxy/bodies.py, proxy/cache_aware.py);
both read the shape here."""

from __future__ import annotations

from typing import Any


def one_prompt(value: Any) -> Any:
    """A list holding exactly one prompt (a string or a token-id list) as that prompt; anything else as it is."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        return value[0]
    return value


def several_prompts(value: Any) -> list[Any] | None:
    """The prompts of a `prompt` that holds several (a list of strings or of token-id lists); None for one."""
    if isinstance(value, list) and len(value) > 1 and all(isinstance(item, (str, list)) for item in value):
        return value
    return None
