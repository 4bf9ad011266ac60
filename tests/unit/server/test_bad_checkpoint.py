"""`hybridpd serve DIR` on a checkpoint it cannot serve: a clear message naming the field, and a non-zero exit."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from hybridpd.presets.checkpoints import write_checkpoint


@pytest.mark.parametrize("overrides, message", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
     "rope_parameters.rope_type 'yarn' is not supported; supported: 'default'"),
    ({"dtype": "float8_e4m3fn"}, "dtype 'float8_e4m3fn' is not supported"),
    ({"architectures": ["MambaForCausalLM"]}, "architectures \\['MambaForCausalLM'\\] is not supported"),
])
def test_serve_exits_with_the_field_named(tmp_path, overrides, message):
    model_dir = write_checkpoint("tiny", tmp_path / "ckpt")
    raw = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(raw | overrides))
    done = subprocess.run([sys.executable, "-m", "hybridpd", "serve", str(model_dir), "--port", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "config.json" in done.stderr
    assert re.search(message, done.stderr), done.stderr
