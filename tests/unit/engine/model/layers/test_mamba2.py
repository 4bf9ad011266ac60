"""Mamba2Mixer's derived weight layouts are views of the parameters: loading a state dict cannot leave them stale."""

from __future__ import annotations

import json

import pytest
import torch

from hybridpd.engine.model.layers.mamba2 import Mamba2Mixer
from hybridpd.engine.model.loader import read_model_config
from hybridpd.presets.checkpoints import PRESETS


def test_conv_weight_follows_a_loaded_state_dict(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny"]))
    config = read_model_config(tmp_path)[0]
    mixer = Mamba2Mixer(config.mamba_shape, 0, torch.float32)
    state = {k: torch.randn_like(v) for k, v in mixer.state_dict().items()}
    assert "conv_weight" not in state  # not persistent: the checkpoint keeps transformers' names only
    assert state["conv1d.weight"].shape == (mixer.conv_dim, 1, mixer.d_conv)
    mixer.load_state_dict(state)
    assert torch.equal(mixer.conv1d.weight, state["conv1d.weight"])
    assert torch.equal(mixer.conv_weight, state["conv1d.weight"][:, 0, :].T)
    assert mixer.conv_weight.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_derived_constants_follow_loaded_or_replaced_parameters(tmp_path, dtype):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny"]))
    mixer = Mamba2Mixer(read_model_config(tmp_path)[0].mamba_shape, 0, dtype)

    def expected():
        return (-torch.exp(mixer.A_log.float()), mixer.D.float(), mixer.dt_bias.float())

    for change in (
        lambda: None,
        lambda: mixer.load_state_dict({k: torch.randn_like(v) for k, v in mixer.state_dict().items()}),
        lambda: _in_place(mixer.D.mul_, 3.0),
        lambda: _in_place(mixer.conv1d.weight.mul_, -2.0),   # a view of the kernel's conv weight
        lambda: setattr(mixer, "dt_bias", torch.nn.Parameter(torch.randn_like(mixer.dt_bias))),
        lambda: setattr(mixer.norm, "weight", torch.nn.Parameter(torch.randn_like(mixer.norm.weight))),
    ):
        change()
        for got, want in zip(mixer._constants(), expected()):
            assert torch.equal(got, want)
        # The compiled kernel's views of the same parameters follow too (fused_mamba.py).
        kernel = mixer._weights_for_kernel()
        A, D, dt_bias = expected()
        for got, want in ((kernel.A, A), (kernel.D, D), (kernel.dt_bias, dt_bias),
                          (kernel.norm_weight, mixer.norm.weight), (kernel.conv_weight, mixer.conv_weight),
                          (kernel.conv_bias, mixer.conv1d.bias)):
            assert torch.equal(torch.from_numpy(got), want.detach().float())


def _in_place(op, *args) -> None:
    """An in-place write as a load makes it (`.data` would write without moving the version counter)."""
    with torch.no_grad():
        op(*args)
