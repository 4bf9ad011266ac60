"""A finished request's vLLM histograms from the outputs the front sees (server/metrics.py): its phases as vLLM
splits them (queue, prefill, decode, inference, time per output token), on a colocated node and on a P/D decode
node (whose first token, the prefill node's, arrives before the request is scheduled here); its tokens and
parameters; and a body of several choices counted once per prompt."""

from __future__ import annotations

from dataclasses import astuple

import pytest
from prometheus_client import CollectorRegistry

from hybridpd.engine.request import FinishReason, RequestOutput
from hybridpd.server.metrics import RequestPhases, RequestTracker, ServerMetrics


@pytest.mark.parametrize("arrival, scheduled, first, last, generated, expected", [
    # colocated: queued 0.5 s, prefill 1 s, 3 more tokens over 1.5 s
    (0.0, 0.5, 1.5, 3.0, 4, RequestPhases(queue=0.5, prefill=1.0, decode=1.5, inference=2.5, per_output_token=0.5)),
    # one token: no decode
    (0.0, 0.25, 1.0, 1.0, 1, RequestPhases(queue=0.25, prefill=0.75, decode=0.0, inference=0.75,
                                           per_output_token=0.0)),
    # a P/D decode node: the prefill node's token first (t=0.1), scheduled at 0.2 (the pull), last token at 1.1
    (0.0, 0.2, 0.1, 1.1, 3, RequestPhases(queue=0.2, prefill=0.0, decode=1.0, inference=0.9, per_output_token=0.5)),
    (0.0, None, None, None, 0, None),   # never scheduled
    (0.0, 0.5, None, None, 0, None),    # scheduled, nothing generated
])
def test_a_requests_phases_are_split_as_vllm_splits_them(arrival, scheduled, first, last, generated, expected):
    got = RequestPhases.of(arrival, scheduled, first, last, generated)
    assert got is None if expected is None else astuple(got) == pytest.approx(astuple(expected))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def output(tokens: int, *, scheduled_at: float | None, finished: bool = False, preemptions: int = 0,
           cached: int = 0, pulled: int = 0) -> RequestOutput:
    return RequestOutput(request_id="r", new_token_ids=(5,) * tokens, new_text="", num_prompt_tokens=10,
                         num_cached_tokens=cached, num_output_tokens=0, finished=finished,
                         finish_reason=FinishReason.LENGTH if finished else None, scheduled_at=scheduled_at,
                         num_preemptions=preemptions, num_pulled_tokens=pulled)


def value(registry: CollectorRegistry, name: str) -> float:
    got = registry.get_sample_value(name, {"model_name": "m", "engine": "0"})
    return 0.0 if got is None else got


@pytest.fixture
def metrics():
    registry = CollectorRegistry()
    return registry, ServerMetrics(registry, "m", 512)


def test_a_decode_node_request_is_observed_once_it_finishes(metrics):
    registry, server = metrics
    clock = Clock()
    tracker = RequestTracker(server, clock, max_tokens=8)
    clock.now = 0.1
    tracker.observe(output(1, scheduled_at=None))                  # the prefill node's token, streamed at once
    assert value(registry, "vllm:request_queue_time_seconds_count") == 0
    clock.now = 0.6
    tracker.observe(output(1, scheduled_at=0.2))                   # after the pull
    clock.now = 1.1
    tracker.observe(output(1, scheduled_at=0.2, finished=True, preemptions=1, cached=4, pulled=6))
    assert value(registry, "vllm:request_queue_time_seconds_sum") == pytest.approx(0.2)
    assert value(registry, "vllm:request_prefill_time_seconds_sum") == 0.0
    assert value(registry, "vllm:request_decode_time_seconds_sum") == pytest.approx(1.0)
    assert value(registry, "vllm:request_inference_time_seconds_sum") == pytest.approx(0.9)
    assert value(registry, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.5)
    assert value(registry, "vllm:request_prefill_kv_computed_tokens_count") == 1
    assert value(registry, "vllm:request_prefill_kv_computed_tokens_sum") == 0   # 4 hit here, 6 pulled
    assert value(registry, "vllm:request_num_preemptions_sum") == 1
    assert value(registry, "vllm:request_params_max_tokens_sum") == 8
    assert value(registry, "vllm:request_params_n_sum") == 1
    assert value(registry, "vllm:request_max_num_generation_tokens_sum") == 3
    for name in ("queue_time_seconds", "decode_time_seconds", "params_n", "num_preemptions"):
        assert value(registry, f"vllm:request_{name}_count") == 1


def test_a_body_of_several_choices_counts_n_and_its_longest_choice_once_per_prompt(metrics):
    registry, server = metrics
    trackers = [RequestTracker(server, Clock(), one_of_choices=True) for _ in range(3)]
    for tracker, tokens in zip(trackers, (2, 5, 3)):
        tracker.observe(output(tokens, scheduled_at=0.0, finished=True))
    assert value(registry, "vllm:request_params_n_count") == 0      # not per choice
    server.observe_choices(3, [t.generated for t in trackers])
    assert value(registry, "vllm:request_params_n_sum") == 3
    assert value(registry, "vllm:request_max_num_generation_tokens_sum") == 5
    assert value(registry, "vllm:request_max_num_generation_tokens_count") == 1
