"""`--pd-threshold` with real nodes (1 prefill + 1 decode, KV events on, `--routing cache_aware --pd-threshold 24`):
a prompt the decode node holds all but a few tokens of is served whole there (no prefill call, no pull) with the
tokens a colocated node gives; a prompt it would compute much of goes through the prefill node; every block is back
in its pool. Synchronised on the proxy having applied every event batch the nodes published, never on time."""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Iterator

import pytest

from hybridpd.launcher.spec import ClusterInfo
from tests.e2e.kv_cluster import BLOCK, cache_aware_cluster, calls, gauge, get, view, wait_synced
from tests.e2e.nodes import assert_blocks_free

THRESHOLD = 24


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[ClusterInfo]:
    with cache_aware_cluster(tmp_path_factory, 1, 1, ("--pd-threshold", str(THRESHOLD))) as (_, info):
        yield info


def _complete(url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _served_alone(info: ClusterInfo) -> float:
    return gauge(get(info.proxy_url + "/metrics"), "hybridpd_proxy_decode_alone_total") or 0.0


def test_a_prompt_the_decode_node_holds_is_served_there_alone(cluster):
    info = cluster
    (prefill,), (decode,) = info.prefill, info.decode
    rng = random.Random(5)
    first = [rng.randrange(1, 200) for _ in range(6 * BLOCK + 5)]
    wait_synced(info)
    answer = _complete(info.proxy_url, first, max_tokens=2 * BLOCK)   # nothing held anywhere: disaggregated
    assert (calls(info, prefill), _served_alone(info)) == (1, 0)
    generated = answer["choices"][0]["text"]
    assert generated

    # The next turn: the same prompt, its answer's tokens and a few more; the decode node holds all but the last few
    turn = first + answer["choices"][0]["token_ids"] + [rng.randrange(1, 200) for _ in range(3)]
    wait_synced(info)
    again = _complete(info.proxy_url, turn, max_tokens=8)
    assert (calls(info, prefill), _served_alone(info)) == (1, 1)
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < len(turn) - cached < THRESHOLD   # computed there, not pulled
    assert again["choices"][0]["text"] == _complete(prefill.url, turn, max_tokens=8)["choices"][0]["text"]

    # A new prompt the decode node holds nothing of goes through the prefill node again
    wait_synced(info)
    _complete(info.proxy_url, [rng.randrange(1, 200) for _ in range(3 * BLOCK)], max_tokens=2)
    assert _served_alone(info) == 1 and calls(info, prefill) == 2   # the proxy's calls (not the one asked directly)
    wait_synced(info)
    for node in (prefill, decode):
        assert_blocks_free(view(node))

