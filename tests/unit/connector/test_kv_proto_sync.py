"""The committed generated modules must be exactly what grpc_tools makes of the committed .proto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PROTO = "hybridpd/proto/kv_transfer.proto"


def _generate(out_dir: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
         f"--grpc_python_out={out_dir}", PROTO],
        cwd=REPO, check=True, capture_output=True, text=True,
    )


@pytest.mark.parametrize("module", ["kv_transfer_pb2.py", "kv_transfer_pb2.pyi", "kv_transfer_pb2_grpc.py"])
def test_generated_module_matches_proto(tmp_path: Path, module: str) -> None:
    _generate(tmp_path)
    fresh = (tmp_path / "hybridpd" / "proto" / module).read_text()
    committed = (REPO / "hybridpd" / "proto" / module).read_text()
    assert committed == fresh, f"hybridpd/proto/{module} is stale: regenerate it (see the header of {PROTO})"


def test_grpc_module_imports_within_the_package() -> None:
    text = (REPO / "hybridpd" / "proto" / "kv_transfer_pb2_grpc.py").read_text()
    assert "from hybridpd.proto import kv_transfer_pb2" in text
    assert "\nimport kv_transfer_pb2" not in text
