"""The proxy in front of real nodes (2 prefill + 1 decode on the tiny checkpoint, via LocalCluster):
greedy outputs equal a colocated node's, streamed or not, completions and chat; then nodes are killed
one by one and the proxy retries, or answers 502 naming the node, without hanging."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hybridpd.launcher.cluster import LocalCluster
from hybridpd.launcher.ports import free_cluster_ports
from hybridpd.launcher.spec import ClusterInfo, ClusterSpec

REQUEST_TIMEOUT = 120.0


def _serve_exists() -> bool:
    """`hybridpd serve` exists when its module imports (it is being written alongside these tests)."""
    try:
        importlib.import_module("hybridpd.server.main")
    except ImportError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _serve_exists(), reason="hybridpd.server.main (`hybridpd serve`) is not importable yet")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[LocalCluster, ClusterInfo]]:
    model = tmp_path_factory.mktemp("tiny-model")
    subprocess.run([sys.executable, "-m", "hybridpd", "make-checkpoint", "--preset", "tiny", "--out", str(model)],
                   check=True, timeout=300)
    proxy_port, base_port = free_cluster_ports(3)
    spec = ClusterSpec(
        num_prefill=2, num_decode=1, model_dir=model, port=proxy_port, base_port=base_port,
        run_dir=tmp_path_factory.mktemp("run"), startup_timeout=240.0, stop_grace=10.0,
        proxy_args=("--prefill-timeout", "60", "--decode-timeout", "60", "--connect-timeout", "2"),
    )
    local = LocalCluster(spec)
    try:
        yield local, local.start()
    finally:
        local.stop()


def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _text(path: str, raw: bytes, stream: bool) -> str:
    if not stream:
        choice = json.loads(raw)["choices"][0]
        return choice["message"]["content"] if path.endswith("chat/completions") else choice["text"]
    pieces = []
    for line in raw.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: "):])
        assert "error" not in event, event
        for choice in event.get("choices", []):
            pieces.append((choice["delta"].get("content") or "") if "delta" in choice else choice["text"])
    return "".join(pieces)


COMPLETION = {"prompt": "The hybrid model reads this prompt of some length, " * 4, "max_tokens": 8,
              "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Say something about prefill and decode."}],
        "max_completion_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("path, body, stream", [
    ("/v1/completions", COMPLETION, False),
    ("/v1/completions", COMPLETION, True),
    ("/v1/chat/completions", CHAT, False),
    ("/v1/chat/completions", CHAT, True),
])
def test_greedy_output_through_the_proxy_equals_a_colocated_node(cluster, path, body, stream):
    _, info = cluster
    body = {**body, "stream": stream}
    status, raw = _post(info.proxy_url + path, body)
    assert status == 200, raw
    local_status, local_raw = _post(info.decode[0].url + path, body)  # no kv_transfer_params: colocated
    assert local_status == 200, local_raw
    assert _text(path, raw, stream) == _text(path, local_raw, stream)
    assert _text(path, raw, stream) != ""


def test_killed_nodes_mean_retry_then_502_naming_the_node(cluster):
    _, info = cluster
    os.kill(info.prefill[0].pid, signal.SIGKILL)
    for _ in range(2):  # round robin would pick the dead node for one of these: the proxy retries
        status, raw = _post(info.proxy_url + "/v1/completions", COMPLETION)
        assert status == 200, raw
    os.kill(info.prefill[1].pid, signal.SIGKILL)
    status, raw = _post(info.proxy_url + "/v1/completions", COMPLETION)
    assert status == 502
    assert "prefill node" in json.loads(raw)["error"]["message"]
    os.kill(info.decode[0].pid, signal.SIGKILL)
    request = urllib.request.Request(info.proxy_url + "/v1/models")
    with pytest.raises(urllib.error.HTTPError) as failure:
        urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT)
    assert failure.value.code == 502
    assert f"decode node {info.decode[0].url.removeprefix('http://')}" in failure.value.read().decode()
    assert Path(info.run_dir / "proxy.log").exists()
