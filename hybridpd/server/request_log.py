"""vLLM's request log, in its words: `--enable-log-requests` logs each chat, completions, Responses or Messages
request as it arrives (INFO: its id and sampling params; DEBUG: its prompt and prompt token ids), and with
`--enable-log-outputs` what it generated once it ends (INFO: the text and finish reason, a stream's marked
"(streaming complete)"; DEBUG: the token ids). `--max-log-len` cuts each prompt, text and id list logged. Logger
`hybridpd.requests`; a prompt and an answer may hold what users wrote, so it is off by default, as vLLM's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the config holds this policy; the engine process reads the config, not the server's modules
    from hybridpd.engine.tokenizer import Tokenizer
    from hybridpd.server.metrics import RequestTracker
    from hybridpd.server.protocol import ParsedRequest

LOGGER = logging.getLogger("hybridpd.requests")


@dataclass(frozen=True)
class RequestLogging:
    requests: bool = False
    outputs: bool = False
    max_len: int | None = None   # characters of a text, ids of a list (None: all)

    def __post_init__(self) -> None:
        if self.outputs and not self.requests:
            raise ValueError("--enable-log-outputs requires --enable-log-requests")
        if self.max_len is not None and self.max_len < 0:
            raise ValueError(f"--max-log-len must be >= 0, got {self.max_len}")

    def _cut(self, items):
        return items if self.max_len is None else items[: self.max_len]

    def inputs(self, parsed: ParsedRequest, tokenizer: Tokenizer) -> None:
        if not self.requests:
            return
        request = parsed.engine_request
        if LOGGER.isEnabledFor(logging.DEBUG):
            ids = list(request.prompt_token_ids)
            prompt = tokenizer.decode(ids, skip_special_tokens=False) if tokenizer.decodes_text else None
            LOGGER.debug("Request %s details: prompt: %r, prompt_token_ids: %s, prompt_embeds shape: %s.",
                         request.request_id, None if prompt is None else self._cut(prompt), self._cut(ids), None)
        LOGGER.info("Received request %s: params: %s, lora_request: %s.", request.request_id, request.sampling, None)

    def outputs_of(self, parsed: ParsedRequest, tracker: RequestTracker) -> None:
        """What the request generated, once it ended (a request that failed or was left logs nothing here)."""
        if not self.outputs or tracker.texts is None or tracker.finish_reason is None:
            return
        request_id = parsed.engine_request.request_id
        streaming = " (streaming complete)" if parsed.stream else ""
        if LOGGER.isEnabledFor(logging.DEBUG):
            LOGGER.debug("Generated response %s%s details: output_token_ids: %s", request_id, streaming,
                         self._cut(tracker.token_ids))
        LOGGER.info("Generated response %s%s: output: %r, finish_reason: %s", request_id, streaming,
                    self._cut("".join(tracker.texts)), tracker.finish_reason.value)
