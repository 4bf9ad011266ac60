"""Pick the next token of each sequence from its logits: the request's logits processors (logits_processors.py),
then greedy, or temperature, min-p, top-k, top-p and a draw from the request's own generator (its seed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridpd.engine.grammar import Grammar, mask_rows_
from hybridpd.engine.logits_processors import TokenHistory, min_p_filter, process_rows_
from hybridpd.engine.request import TokenLogprob
from hybridpd.engine.sampling_params import SamplingParams


_NO_HISTORY = TokenHistory((), ())   # a row whose parameters ask for no processor


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    logits = min_p_filter(logits, min_p)
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def _race(probs: torch.Tensor, generators: list[torch.Generator | None], seeded: list[bool] | None = None) -> list[int]:
    """One token per row of `probs` [R, vocab], drawn from that row's distribution: the argmax of p / E with E ~ Exp(1)
    per token (the exponential race, as vLLM's sampler draws), each row's noise from its own generator in one
    `_exponential_` of the vocabulary's size (what `skip_draw` consumes). When no row's request gave a seed
    (`seeded`), no stream owes anyone a sequence: the batch's noise comes in one call from the first row's generator
    (16 calls' own cost was ~15 of the 175 us a draw of 16 rows of 512 tokens took). Modifies `probs`."""
    noise = torch.empty_like(probs)
    if len(generators) > 1 and seeded is not None and not any(seeded):
        _exponential_(noise, generators[0])
    else:
        for row, generator in zip(noise, generators):
            _exponential_(row, generator)
    return probs.div_(noise).argmax(dim=-1).tolist()


def _exponential_(noise: torch.Tensor, generator: torch.Generator | None) -> None:
    """Fill `noise` with Exp(1) draws as -log(U), U uniform in [0, 1) (24-bit float32 steps: every draw is above 0,
    so no p / E is 0 / 0; the largest is 16.6). torch's own `exponential_` ran 5x as long on a CPU: 22 against 4.3
    ms for 16 rows of a 100,352-token vocabulary (EPYC-AVX512-BF16)."""
    noise.uniform_(generator=generator).log_().neg_()


def _unfiltered(params: SamplingParams, vocab_size: int) -> bool:
    return (params.top_k <= 0 or params.top_k >= vocab_size) and params.top_p >= 1.0 and params.min_p <= 0


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
               history: TokenHistory | None = None, eos_token_ids: frozenset[int] = frozenset()) -> SampledToken:
    """`logits` is one sequence's [vocab] float32 row; `history` its tokens, which a request whose parameters shape
    its logits needs (`SamplingParams.shapes_logits`). Logprobs are of `logits` as they come."""
    return sample(logits.unsqueeze(0), [params], [generator], [history], eos_token_ids)[0]


def _sample_row(chosen: torch.Tensor, raw: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None) -> SampledToken:
    """A token drawn from the processed row `chosen`, its logprobs from the model's own row `raw`."""
    if params.greedy:
        token = int(torch.argmax(chosen))
    else:
        filtered = _filter_top_k_top_p(chosen / params.temperature, params.top_k, params.top_p, params.min_p)
        token = _race(torch.softmax(filtered, dim=-1).unsqueeze(0), [generator])[0]
    logprob = None
    if params.logprobs is not None:
        logprobs = torch.log_softmax(raw, dim=-1)
        top = torch.topk(logprobs, params.logprobs) if params.logprobs > 0 else None
        logprob = TokenLogprob(
            token_id=token,
            logprob=float(logprobs[token]),
            top=tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else (),
        )
    return SampledToken(token, logprob)


def skip_draw(generator: torch.Generator, vocab_size: int) -> None:
    """Advance `generator` past one draw, as if it had sampled a token (another node did: the prefill node of a P/D
    request samples the first token from the same seed). A draw consumes the generator by its noise's shape only."""
    _exponential_(torch.empty(vocab_size), generator)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           histories: list[TokenHistory | None] | None = None,
           eos_token_ids: frozenset[int] = frozenset(),
           grammars: list[Grammar | None] | None = None) -> list[SampledToken]:
    """Rows of `logits` [S, vocab] in the order of `params`; `histories` holds the tokens of each row whose parameters
    shape its logits (None for the others), `grammars` each constrained row's matcher. Constrained rows are masked
    first (grammar.py), then the rows whose parameters shape them are processed, together (logits_processors.py);
    then greedy rows without logprobs share one argmax, random rows without logprobs, min-p, top-k or top-p share one
    softmax and one race (each with its own generator's noise). Logprobs are of the rows as the model gave them,
    masked by their grammar (as vLLM's, whose bitmask comes before its sampler)."""
    constrained = [i for i, g in enumerate(grammars or ()) if g is not None]
    if constrained:
        logits = logits.to(torch.float32, copy=True).contiguous()
        mask_rows_(logits, constrained, [grammars[i] for i in constrained])  # type: ignore[index,misc]
    raw = logits
    shaped = [i for i, p in enumerate(params) if p.shapes_logits]
    if shaped:
        if histories is None or any(histories[i] is None for i in shaped):
            raise ValueError("sample: a request's logits depend on its tokens; pass its history")
        logits = logits.to(torch.float32, copy=True).contiguous()
        # the other rows' parameters ask for nothing: they pass through as they are
        process_rows_(logits, params, [h or _NO_HISTORY for h in histories], eos_token_ids)
    plain_greedy = [i for i, p in enumerate(params) if p.greedy and p.logprobs is None]
    out: list[SampledToken | None] = [None] * len(params)
    if plain_greedy:
        rows = logits if len(plain_greedy) == len(params) else logits[plain_greedy]
        tokens = torch.argmax(rows, dim=-1).tolist()
        for i, token in zip(plain_greedy, tokens):
            out[i] = SampledToken(token, None)
    vocab_size = logits.shape[-1]
    plain_random = [i for i, p in enumerate(params)
                    if not p.greedy and p.logprobs is None and _unfiltered(p, vocab_size)]
    if plain_random:
        temperatures = torch.tensor([params[i].temperature for i in plain_random], dtype=logits.dtype)
        probs = torch.softmax(logits[plain_random] / temperatures.unsqueeze(1), dim=-1)
        tokens = _race(probs, [generators[i] for i in plain_random], [params[i].seed is not None for i in plain_random])
        for i, token in zip(plain_random, tokens):
            out[i] = SampledToken(token, None)
    for i, p in enumerate(params):
        if out[i] is None:
            out[i] = _sample_row(logits[i], raw[i], p, generators[i])
    return out  # type: ignore[return-value]
