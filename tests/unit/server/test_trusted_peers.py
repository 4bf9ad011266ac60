"""`--kv-trusted-peers`: a decode node pulls only from peers it trusts (pulled blocks enter its prefix cache)."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from hybridpd.connector.trusted_peers import LOOPBACK_ONLY, TrustedPeers
from hybridpd.server.args import configs_from_args

from .conftest import make_app


@pytest.mark.parametrize("entries, host, allowed", [
    (LOOPBACK_ONLY, "127.0.0.1", True),
    (LOOPBACK_ONLY, "127.9.9.9", True),
    (LOOPBACK_ONLY, "::1", True),
    (LOOPBACK_ONLY, "[::1]", True),
    (LOOPBACK_ONLY, "localhost", True),
    (LOOPBACK_ONLY, "10.0.0.5", False),
    (LOOPBACK_ONLY, "evil.example", False),
    (["10.77.0.0/24"], "10.77.0.1", True),
    (["10.77.0.0/24"], "10.77.1.1", False),
    (["10.0.0.0/8,172.16.0.0/12", "prefill-0.hybridpd"], "172.20.3.4", True),
    (["10.0.0.0/8,172.16.0.0/12", "prefill-0.hybridpd"], "PREFILL-0.hybridpd", True),
    (["10.0.0.0/8,172.16.0.0/12", "prefill-0.hybridpd"], "prefill-1.hybridpd", False),
    (["192.0.2.7"], "192.0.2.7", True),
    (["192.0.2.7"], "192.0.2.8", False),
])
def test_allows(entries, host, allowed):
    assert TrustedPeers.parse(entries).allows(host) is allowed


@pytest.mark.parametrize("entries, message", [
    ([""], "at least one"),
    (["10.0.0.0/33"], "neither a CIDR"),
    (["bad host!"], "neither a CIDR"),
])
def test_bad_entries(entries, message):
    with pytest.raises(ValueError, match=message):
        TrustedPeers.parse(entries)


def _remote(host: str) -> dict:
    return {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r", "remote_block_ids": [[1]],
            "remote_host": host, "remote_port": 9100, "remote_num_tokens": 5, "first_token_id": 7}


@pytest.mark.parametrize("trusted, host, status", [
    (None, "127.0.0.1", 200),              # the default: loopback only
    (None, "203.0.113.9", 403),
    (["203.0.113.0/24"], "203.0.113.9", 200),
    (["203.0.113.0/24"], "127.0.0.1", 403),
])
async def test_a_pull_from_an_untrusted_peer_is_refused_before_the_engine_sees_it(engine, trusted, host, status):
    config = {} if trusted is None else {"trusted_peers": TrustedPeers.parse(trusted)}
    client = TestClient(TestServer(make_app(engine, **config)))
    await client.start_server()
    try:
        body = {"prompt": "hello", "max_tokens": 1, "kv_transfer_params": _remote(host)}
        answer = await client.post("/v1/completions", json=body)
        assert answer.status == status, await answer.text()
        if status == 403:
            error = (await answer.json())["error"]
            assert error["type"] == "permission_error" and host in error["message"]
            assert "--kv-trusted-peers" in error["message"]
            assert engine.requests == []   # refused before admission: nothing allocated, nothing pulled
    finally:
        await client.close()


def test_the_serve_flag_reaches_the_server_config(tmp_path):
    import argparse

    from hybridpd.server.args import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([str(tmp_path), "--kv-trusted-peers", "10.1.0.0/16,10.2.0.0/16", "prefill.local"])
    peers = configs_from_args(args, default_model_dir=lambda: tmp_path).server.trusted_peers
    assert peers.allows("10.2.3.4") and peers.allows("prefill.local") and not peers.allows("127.0.0.1")
