"""What a request's sampling parameters do to its logits before a token is drawn, in vLLM's order: allowed_token_ids,
bad_words, min_tokens' masks, logit_bias, then the repetition, frequency and presence penalties. (min_p, top-k and top-p come after the
temperature, in sampling.py; logprobs are of the logits before all of this, as vLLM's default `raw_logprobs`.)

- allowed_token_ids: every other token masked (-inf);
- bad_words: a word's last token masked where the output ends with the word's other tokens (always, for a word of one
  token), so that no word in the list is ever written as those tokens;
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
    return process_rows(logits.unsqueeze(0), [params], [history], eos_token_ids)[0]


def process_rows(logits: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory],
                 eos_token_ids: frozenset[int]) -> torch.Tensor:
    """A new float32 [R, vocab]: each row of `logits` with its request's processors applied (the input is not
    changed)."""
    return process_rows_(logits.to(torch.float32, copy=True), params, histories, eos_token_ids)


def process_rows_(out: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory],
                  eos_token_ids: frozenset[int]) -> torch.Tensor:
    """`out` (contiguous float32 [R, vocab]) with each row's processors applied in place, a few batched ops for all
    rows; returns it."""
    rows, vocab = out.shape
    for r, p in enumerate(params):
        if p.allowed_token_ids is not None:
            allowed = torch.tensor(p.allowed_token_ids, dtype=torch.int64)
            kept = out[r, allowed]
            out[r].fill_(float("-inf"))
            out[r, allowed] = kept
    banned = [(r, token) for r, (p, h) in enumerate(zip(params, histories)) for token in _bad_word_ends(p, h.output)]
    if banned:
        out[tuple(torch.tensor(banned, dtype=torch.int64).T)] = float("-inf")
    masked = [(r, i) for r, (p, h) in enumerate(zip(params, histories)) if len(h.output) < p.min_tokens
              for i in set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids) if 0 <= i < vocab]
    if masked:
        out[tuple(torch.tensor(masked, dtype=torch.int64).T)] = float("-inf")
    biases = [(r, token, bias) for r, p in enumerate(params) for token, bias in p.logit_bias]
    if biases:
        where = torch.tensor([(r, t) for r, t, _ in biases], dtype=torch.int64).T
        out.index_put_(tuple(where), torch.tensor([b for _, _, b in biases], dtype=out.dtype), accumulate=True)
    penalized = [r for r, p in enumerate(params) if p.penalized]
    if penalized:
        _penalize_(out, penalized, [params[r] for r in penalized], [histories[r] for r in penalized])
    return out


def _bad_word_ends(params: SamplingParams, output: Sequence[int]) -> set[int]:
    """The tokens that would end a bad word after `output`."""
    ends = set()
    for word in params.bad_words_token_ids:
        before = len(word) - 1
        if before == 0 or (len(output) >= before and tuple(output[len(output) - before:]) == word[:-1]):
            ends.add(word[-1])
    return ends


def _penalize_(out: torch.Tensor, rows: list[int], params: list[SamplingParams],
               histories: list[TokenHistory]) -> None:
    """Rows `rows` of `out` [R, vocab] with their repetition, then frequency and presence penalties (vLLM's
    apply_penalties), in place, computed on the entries the prompts and outputs name only: a step's cost follows
    their lengths, not the vocabulary's (a dense [R, vocab] pass per penalty would cost ~1 ms a step at 16 rows of a
    100k vocabulary)."""
    vocab = out.shape[1]
    flat = out.view(-1)   # entries addressed as row * vocab + token: index_select / index_copy_ are the cheap ops

    def per_row(values: list[float], neutral: float) -> torch.Tensor:
        """A value for every row of `out` (`neutral` for the rows not in `rows`), to index by a key's row."""
        of_row = torch.full((out.shape[0],), neutral, dtype=out.dtype)
        of_row[rows] = torch.tensor(values, dtype=out.dtype)
        return of_row

    outputs = torch.tensor([t + r * vocab for r, h in zip(rows, histories) for t in h.output], dtype=torch.int64)
    repetition = [p.repetition_penalty for p in params]
    if any(r != 1 for r in repetition):
        prompts = [torch.as_tensor(h.prompt, dtype=torch.int64) for h in histories]
        prompt_rows = torch.repeat_interleave(torch.tensor(rows), torch.tensor([len(t) for t in prompts]))
        keys = torch.cat([torch.cat(prompts) + prompt_rows * vocab, outputs])
        values = flat.index_select(0, keys)
        penalty = per_row(repetition, 1.0).index_select(0, keys // vocab)
        flat.index_copy_(0, keys, torch.where(values > 0, values / penalty, values * penalty))  # a key named twice
    if outputs.numel():                                                                      # writes one value
        keys, counts = torch.unique(outputs, return_counts=True)
        owners = keys // vocab
        frequency = per_row([p.frequency_penalty for p in params], 0.0).index_select(0, owners)
        presence = per_row([p.presence_penalty for p in params], 0.0).index_select(0, owners)
        flat.index_copy_(0, keys, flat.index_select(0, keys) - frequency * counts.to(out.dtype) - presence)

def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """`logits` (temperature applied) with the tokens whose probability is below `min_p` x the likeliest one's set to
    -inf, as vLLM's min_p processor."""
    if min_p <= 0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
