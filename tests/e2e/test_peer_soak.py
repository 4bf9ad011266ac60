"""A decode node meets thousands of distinct prefill peers (requests naming 5,000 different `remote_port`s, as
prefill pods coming and going under DNS discovery do, or a client that names any port): its side-channel clients and
transport peers stay bounded (an LRU with idle expiry, decode_node/peers.py), so the engine process's open file
descriptors and resident memory stay flat.

Every request carries well-formed params (taken from a real prefill call) with another port, nobody listens there,
and its pull fails: a 502 naming the peer, the blocks back in the pool. Flat means: after the first 1,000 peers
(the LRU full, the allocator warm), 4,000 more peers add at most FD_MARGIN descriptors and RSS_MARGIN_KIB of
memory. Before the LRU, 6,000 peers took the engine from 467 to 616 MB and it kept growing while idle.
"""

from __future__ import annotations

import json
import os
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from hybridpd.presets.checkpoints import write_checkpoint
from tests.e2e.nodes import assert_blocks_free, process_tree, start_node
from tests.e2e.pd_calls import greedy_body, prefill_call

PEERS = 5000
WARM = 1000
FIRST_PORT = 40000          # 40000..44999: outside the ephemeral range, where nothing of this test listens
FD_MARGIN = 16
RSS_MARGIN_KIB = 24 * 1024
SERVE_ARGS = ["--kv-cache-memory", "32MiB", "--max-model-len", "256", "--kv-load-timeout", "5"]


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint("tiny", tmp_path_factory.mktemp("model"))


def test_thousands_of_distinct_peers_leave_descriptors_and_memory_flat(model_dir, tmp_path):
    prefill = start_node(model_dir, tmp_path, SERVE_ARGS, name="prefill")
    decode = start_node(model_dir, tmp_path, SERVE_ARGS, name="decode")
    try:
        body = greedy_body(list(range(5, 45)), max_tokens=2)
        params = prefill_call(prefill, body)
        engine = process_tree(decode.proc.pid)[1]

        def pull_from(port: int) -> int:
            data = json.dumps({**body, "kv_transfer_params": {**params, "remote_port": port}}).encode()
            request = urllib.request.Request(decode.url + "/v1/completions", data=data,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    return response.status
            except urllib.error.HTTPError as exc:
                answer = json.loads(exc.read())
                assert f"127.0.0.1:{port}" in answer["error"]["message"], answer
                return exc.code

        with ThreadPoolExecutor(8) as pool:
            assert set(pool.map(pull_from, range(FIRST_PORT, FIRST_PORT + WARM))) == {502}
            fds, rss = _fds(engine), _rss_kib(engine)
            assert set(pool.map(pull_from, range(FIRST_PORT + WARM, FIRST_PORT + PEERS))) == {502}
        grown_fds, grown_rss = _fds(engine) - fds, _rss_kib(engine) - rss
        print(f"after {WARM} peers: {fds} fds, {rss} KiB; {PEERS - WARM} more: {grown_fds:+d} fds, "
              f"{grown_rss:+d} KiB")
        assert grown_fds <= FD_MARGIN, (fds, grown_fds)
        assert grown_rss <= RSS_MARGIN_KIB, (rss, grown_rss)
        assert_blocks_free(decode)
    finally:
        decode.kill()
        prefill.kill()
