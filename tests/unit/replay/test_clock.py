"""The simulator's clock on a table of small cases: a prefill waits for its node and, with `cores`, for a core the
nodes share; `request_s` is paid by every request; a hit is not computed. Exact figures, from the clock's own terms."""

from __future__ import annotations

import pytest
import torch

from hybridpd.bench import mooncake
from hybridpd.presets.checkpoints import write_checkpoint
from hybridpd.proxy.config import RoutingPolicy
from hybridpd.replay.node import NodeLayout
from hybridpd.replay.simulator import ClusterShape, simulate
from hybridpd.replay.time_model import TimeModel

PER_TOKEN = 1e-3
SLICE = mooncake.TraceSlice(tokens_per_hash=64, max_output_len=1)


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    torch.set_num_threads(1)
    return NodeLayout.of(write_checkpoint("tiny", tmp_path_factory.mktemp("tiny")), 4 << 20, 16, 4, 512)


def _records(*spec: tuple[float, tuple[int, ...]]) -> list[mooncake.TraceRecord]:
    """(arrival ms, hash ids): each id 64 tokens here, the prompt exactly its ids."""
    return [mooncake.TraceRecord(timestamp_ms=t, input_length=512 * len(ids), output_length=1, hash_ids=ids)
            for t, ids in spec]


@pytest.mark.parametrize("records, cores, request_s, request_cpu_s, ttfts", [
    # two prompts of 128 tokens at once, a prefill node each: in parallel, unless one core is all the nodes have
    (_records((0, (1, 2)), (0, (3, 4))), 0, 0.0, 0.0, [0.128, 0.128]),
    (_records((0, (1, 2)), (0, (3, 4))), 1, 0.0, 0.0, [0.128, 0.256]),
    (_records((0, (1, 2)), (0, (3, 4))), 2, 0.01, 0.0, [0.138, 0.138]),
    # each request's own CPU comes first on the one core: r1's [0, .05), its prefill [.05, .178), r2's [.178, .228),
    # its prefill [.228, .356)
    (_records((0, (1, 2)), (0, (3, 4))), 1, 0.0, 0.05, [0.178, 0.356]),
    (_records((0, (1, 2)), (0, (3, 4))), 0, 0.0, 0.05, [0.128, 0.128]),   # no shared cores: nothing to wait for
    # the second arrives once the first is done: no wait, whatever the cores
    (_records((0, (1, 2)), (500, (3, 4))), 1, 0.0, 0.0, [0.128, 0.128]),
])
def test_prefills_wait_for_their_node_and_a_shared_core(layout, records, cores, request_s, request_cpu_s, ttfts):
    clock = TimeModel(prefill_s_per_token=PER_TOKEN, step_s=0.0, decode_step_s=0.0, request_s=request_s,
                      request_cpu_s=request_cpu_s, cores=cores)
    result = simulate(records, SLICE, layout, ClusterShape(prefill=2, decode=1), RoutingPolicy.ROUND_ROBIN, clock, 256)
    assert result["prompt_tokens"] == 256
    assert result["mean_ttft_s"] == pytest.approx(sum(ttfts) / len(ttfts))


def test_a_clock_term_must_be_a_count_or_a_duration():
    with pytest.raises(ValueError, match="cores"):
        TimeModel(cores=-1)
    with pytest.raises(ValueError, match="cores must be a whole number"):
        TimeModel(cores=1.5)
