"""A sampled request's generator: its own seed when it has one, fresh entropy when not, the global RNG untouched."""

from __future__ import annotations

import torch

from hybridpd.engine.request import EngineRequest
from hybridpd.engine.sampling_params import SamplingParams
from hybridpd.engine.sequence import Sequence


def _sequence(seed: int | None, temperature: float = 1.0) -> Sequence:
    request = EngineRequest(request_id="r", prompt_token_ids=(1, 2, 3),
                            sampling=SamplingParams(temperature=temperature, seed=seed))
    return Sequence.from_request(request, arrival_order=0, decode_skip_mamba_align=True, vocab_size=8)


def test_seeded_requests_draw_alike_and_unseeded_ones_apart():
    torch.manual_seed(123)
    global_state = torch.get_rng_state()
    seeded = [_sequence(7).generator for _ in range(2)]
    unseeded = [_sequence(None).generator for _ in range(3)]
    assert torch.equal(seeded[0].get_state(), seeded[1].get_state())
    assert seeded[0].initial_seed() == 7
    seeds = {g.initial_seed() for g in unseeded}
    assert len(seeds) == 3 and torch.Generator().initial_seed() not in seeds  # not the default seed either
    assert torch.equal(torch.get_rng_state(), global_state)  # nobody reseeded the process's RNG
    assert _sequence(None, temperature=0.0).generator is None  # greedy draws nothing
