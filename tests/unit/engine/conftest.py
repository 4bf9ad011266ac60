from __future__ import annotations

import pytest
import torch

from hybridpd.presets.checkpoints import write_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return write_checkpoint("tiny", tmp_path_factory.mktemp("tiny"))
