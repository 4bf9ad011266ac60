"""The logprobs of a prompt's own tokens (vLLM's `prompt_logprobs`): for each prompt position after the first, the
model's logprob of the token there given the tokens before it, its rank, and the likeliest tokens beside it.

They come from the final hidden rows of the positions before each token, turned into logits a slice of rows at a
time: a row of logits is the vocabulary's size (a 2,048-token chunk of a 100k vocabulary would be 800 MB at once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridpd.engine.request import TokenLogprob

SLICE_ROWS = 128


@dataclass(frozen=True)
class PromptRows:
    """Rows of a step that score prompt tokens of one request: row i predicts prompt position `first_target + i`."""

    request_id: str
    first_target: int
    targets: tuple[int, ...]   # the prompt's tokens at those positions
    num_top: int


def score_rows(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: tuple[int, ...],
               num_top: int) -> list[TokenLogprob]:
    """One TokenLogprob per row of `hidden` [R, H] for its target token, from the float32 logits `logits_of` gives
    (log-softmax over the whole vocabulary, as the model gave them: no sampling parameter shapes them)."""
    out: list[TokenLogprob] = []
    for start in range(0, len(targets), SLICE_ROWS):
        logprobs = torch.log_softmax(logits_of(hidden[start:start + SLICE_ROWS]), dim=-1)
        wanted = torch.tensor(targets[start:start + SLICE_ROWS], dtype=torch.int64)
        chosen = logprobs.gather(1, wanted.unsqueeze(1))
        ranks = (logprobs > chosen).sum(dim=1).add_(1).tolist()
        top_ids: list[list[int]] = [[] for _ in ranks]
        top_values: list[list[float]] = [[] for _ in ranks]
        if num_top > 0:
            top = torch.topk(logprobs, num_top, dim=1)
            top_ids, top_values = top.indices.tolist(), top.values.tolist()
        for token, logprob, rank, ids, values in zip(wanted.tolist(), chosen.squeeze(1).tolist(), ranks, top_ids,
                                                     top_values):
            out.append(TokenLogprob(token_id=token, logprob=logprob, top=tuple(zip(ids, values)), rank=rank))
    return out
