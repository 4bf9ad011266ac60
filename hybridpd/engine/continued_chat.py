"""A conversation rendered so that the model continues its final message (vLLM's and transformers'
`continue_final_message`): a prefilled start of the assistant's answer, say, with no end-of-turn after it.

As transformers does it, so that both give the same prompt: the final message's text is tagged at its end, the
conversation rendered without a generation prompt, and the rendering cut at the tag (and the whitespace before it,
when the template trimmed the message); a template that drops the message's text cannot be continued.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridpd.engine.tokenizer import Tokenizer, message_text
from hybridpd.errors import InvalidRequestError

# transformers' tag, trailing space included: whether the template kept it tells whether it trimmed the message.
TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def render_continuing(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                      template_kwargs: Mapping[str, Any] | None = None,
                      tools: list[dict[str, Any]] | None = None) -> str:
    """The conversation (at least one message, as the server's parse gives it) as the chat template renders it,
    ending inside its final message's text."""
    final = messages[-1]
    _, text = message_text(final)
    tagged = [*messages[:-1], {**final, "content": text + TAG}]
    rendered = tokenizer.apply_chat_template(tagged, False, template_kwargs, tools)
    at = rendered.rfind(TAG.strip())
    if at < 0 or text.strip() not in rendered:
        raise InvalidRequestError("continue_final_message is set but the chat template does not render the final "
                                  "message's text, so it cannot be continued", "messages")
    return rendered[:at] if rendered.startswith(TAG, at) else rendered[:at].rstrip()
