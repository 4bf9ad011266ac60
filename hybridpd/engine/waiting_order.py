"""The order a step admits waiting requests in under `--scheduling-policy sjf`: shortest job first, with a wait bound.

Prompts that arrive together (a burst: the conversation trace's requests come in bursts every few seconds) are
computed in the steps that follow, and every prompt of a step gets its first token at the step's end. On a CPU a
prefill step costs about a fixed few milliseconds plus its tokens, so taking a burst's prompts together gives none of
them its token sooner, while taking the fewest uncached tokens first, a few hundred tokens a step, gives most of them
their token after a fraction of the burst's time (`benchmarks/README.md`: the same burst's mean TTFT at about half).
A request is ranked by its prompt less the local hit it had when it arrived (an estimate: vLLM's residual-aware
proposal ranks the same way). A preempted request and one whose prompt a prefill node computed (it computes nothing
here: it only starts its pull) go first, as FCFS puts them; a request that has waited `max_wait` seconds goes before
every shorter one, in arrival order, so a long prompt under a stream of short ones still starts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from hybridpd.engine.sequence import Sequence


def shortest_first(waiting: Iterable[Sequence], now: float, max_wait: float) -> deque[Sequence]:
    return deque(sorted(waiting, key=lambda seq: rank(seq, now, max_wait)))


def rank(seq: Sequence, now: float, max_wait: float) -> tuple[int, int, int]:
    """Lower first: (tier, uncached tokens, arrival)."""
    if seq.num_preemptions or seq.remote_prefill is not None:
        return 0, 0, seq.arrival_order
    if now - seq.queued_at >= max_wait:
        return 1, 0, seq.arrival_order
    return 2, seq.uncached_estimate, seq.arrival_order
