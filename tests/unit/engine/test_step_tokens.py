"""Tokens per engine step as vLLM's `vllm:iteration_tokens_total` histogram (engine/step_tokens.py): a step of as
many tokens as a bound counts in that bound's bucket; the buckets are cumulative, written as prometheus_client (and
vLLM) write them."""

from __future__ import annotations

import pytest

from hybridpd.engine.step_tokens import ITERATION_TOKENS_BUCKETS, step_token_counts


@pytest.mark.parametrize("steps, at_most", [
    # steps' tokens -> cumulative counts at le = 1, 8, 16 and +Inf
    ([1], (1, 1, 1, 1)),
    ([0, 1, 2], (2, 3, 3, 3)),
    ([8, 9, 16, 17], (0, 1, 3, 4)),
    ([16384, 16385], (0, 0, 0, 2)),
])
def test_a_step_counts_at_every_bound_it_does_not_exceed(steps, at_most):
    counter = step_token_counts()
    for tokens in steps:
        counter.observe(tokens)
    snapshot = counter.snapshot()
    cumulative = dict(snapshot.cumulative())
    assert (cumulative["1.0"], cumulative["8.0"], cumulative["16.0"], cumulative["+Inf"]) == at_most
    assert [bound for bound, _ in snapshot.cumulative()] == [*(f"{b}.0" for b in ITERATION_TOKENS_BUCKETS), "+Inf"]
    assert (snapshot.count, snapshot.total) == (len(steps), sum(steps))
