"""Nodes from a watched file (`--nodes-file`): rewriting it moves requests, a broken file keeps the last nodes."""

from __future__ import annotations

import argparse
import asyncio
import json

import aiohttp
import pytest

from hybridpd.proxy.app import PROXY_KEY
from hybridpd.proxy.config import Role, RoutingPolicy, Upstream
from hybridpd.proxy.main import add_arguments, config_from_args
from hybridpd.proxy.nodes_file import NodesFile, parse_nodes
from hybridpd.proxy.routing import Router

from .conftest import proxy_config, serve_proxy
from .fake_node import FakeNode

WAIT_ROUNDS = 200  # rounds of 50 ms at most (bounded waiting, never a timed assertion)


@pytest.mark.parametrize("text, expected", [
    ('{"prefill": ["10.0.0.1:8100"], "decode": ["10.0.0.2:8100", "[::1]:8200"]}',
     {Role.PREFILL: [("10.0.0.1", 8100)], Role.DECODE: [("10.0.0.2", 8100), ("::1", 8200)]}),
    ('{"decode": ["d:1"]}', {Role.PREFILL: [], Role.DECODE: [("d", 1)]}),
])
def test_parse_nodes(text, expected):
    nodes = parse_nodes(text)
    assert {role: [(u.host, u.port) for u in ups] for role, ups in nodes.items()} == expected


@pytest.mark.parametrize("text, message", [
    ('["a:1"]', "JSON object"),
    ('{"prefill": ["a:1"], "other": []}', "JSON object"),
    ('{"prefill": "a:1"}', "must be a list"),
    ('{"prefill": ["a"]}', 'is not "host:port"'),
    ('{"decode": [7]}', "is not"),
    ('{"decode": ["a:99999"]}', "port out of range"),
])
def test_bad_nodes_files(text, message):
    with pytest.raises(ValueError, match=message):
        parse_nodes(text)


async def test_a_broken_rewrite_keeps_the_last_good_nodes(tmp_path):
    path = tmp_path / "nodes.json"
    path.write_text('{"prefill": ["a:1"], "decode": ["b:2"]}')
    routers = {role: Router((), RoutingPolicy.ROUND_ROBIN, role.value) for role in Role}
    watcher = NodesFile(path, routers)
    await watcher.refresh()
    assert routers[Role.DECODE].upstreams == (Upstream(role=Role.DECODE, host="b", port=2),)
    path.write_text('{"decode": ["b:2", "c:3"')       # half written
    await watcher.refresh()
    assert [u.host for u in routers[Role.DECODE].upstreams] == ["b"]
    path.write_text('{"decode": ["c:3"]}')
    await watcher.refresh()
    assert [u.host for u in routers[Role.DECODE].upstreams] == ["c"] and routers[Role.PREFILL].upstreams == ()


async def test_rewriting_the_file_moves_requests_without_a_restart(tmp_path):
    prefill, first, second = FakeNode(), FakeNode(), FakeNode()
    for node in (prefill, first, second):
        await node.start()
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps({"prefill": [f"127.0.0.1:{prefill.port}"], "decode": [f"127.0.0.1:{first.port}"]}))
    runner, base = await serve_proxy(proxy_config(["--nodes-file", str(path), "--dns-interval", "0.1"]))
    url = base + "/v1/completions"
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json=body) as answer:
                assert answer.status == 200
            path.write_text(json.dumps({"prefill": [f"127.0.0.1:{prefill.port}"],
                                        "decode": [f"127.0.0.1:{second.port}"]}))
            router = runner.app[PROXY_KEY].routers[Role.DECODE]
            for _ in range(WAIT_ROUNDS):
                if [u.port for u in router.upstreams] == [second.port]:
                    break
                await asyncio.sleep(0.05)
            for _ in range(2):
                async with session.post(url, json=body) as answer:
                    assert answer.status == 200
        assert (len(first.received), len(second.received)) == (1, 2)
    finally:
        await runner.cleanup()
        for node in (prefill, first, second):
            await node.stop()


def test_nodes_file_excludes_the_other_node_flags(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match="--nodes-file gives every node: drop --decoder-hosts"):
        config_from_args(parser.parse_args(["--nodes-file", str(tmp_path / "n.json"), "--decoder-hosts", "x"]))
