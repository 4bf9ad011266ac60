"""What a request's sampling parameters do to its logits before a token is drawn, in vLLM's order: allowed_token_ids,
min_tokens' masks, logit_bias, then the repetition, frequency and presence penalties. (min_p, top-k and top-p come after the
temperature, in sampling.py; logprobs are of the logits before all of this, as vLLM's default `raw_logprobs`.)

- allowed_token_ids: every other token masked (-inf);
- min_tokens: until the output holds that many tokens, the stop token ids and, unless ignore_eos, the EOS ids are
  masked (-inf);
- logit_bias: each listed token's bias added to its logit;
- repetition_penalty r (transformers' and vLLM's): a token in the prompt or the output has its logit divided by r
  when positive, multiplied by r otherwise;
- frequency_penalty f and presence_penalty p (OpenAI's): minus f times the token's count in the output, minus p when
  the output holds it at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridpd.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenHistory:
    """The tokens a row's logits may depend on: its prompt (ids, or an int64 tensor of them) and the output so far."""

    prompt: Sequence[int] | torch.Tensor
    output: Sequence[int]


def process_logits(logits: torch.Tensor, params: SamplingParams, history: TokenHistory,
                   eos_token_ids: frozenset[int]) -> torch.Tensor:
    """A new float32 [vocab] row: `logits` [vocab] with `params`' processors applied (the input is not changed)."""
    out = logits.float().clone()
    vocab = out.shape[0]
    if params.allowed_token_ids is not None:
        allowed = torch.tensor(params.allowed_token_ids, dtype=torch.int64)
        kept = out[allowed]
        out.fill_(float("-inf"))
        out[allowed] = kept
    if len(history.output) < params.min_tokens:
        masked = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
        ids = [i for i in masked if 0 <= i < vocab]
        if ids:
            out[ids] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor([token for token, _ in params.logit_bias])
        out.index_add_(0, ids, torch.tensor([bias for _, bias in params.logit_bias], dtype=out.dtype))
    if params.penalized:
        _penalize(out, params, history)
    return out


def _penalize(out: torch.Tensor, params: SamplingParams, history: TokenHistory) -> None:
    vocab = out.shape[0]
    output = torch.tensor(list(history.output), dtype=torch.int64)
    counts = torch.bincount(output, minlength=vocab)[:vocab].to(out.dtype)
    if params.repetition_penalty != 1:
        seen = counts > 0
        seen[torch.as_tensor(history.prompt, dtype=torch.int64)] = True
        penalty = params.repetition_penalty
        out.copy_(torch.where(seen, torch.where(out > 0, out / penalty, out * penalty), out))
    if params.frequency_penalty:
        out.sub_(params.frequency_penalty * counts)
    if params.presence_penalty:
        out.sub_(params.presence_penalty * (counts > 0).to(out.dtype))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """`logits` (temperature applied) with the tokens whose probability is below `min_p` x the likeliest one's set to
    -inf, as vLLM's min_p processor."""
    if min_p <= 0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
