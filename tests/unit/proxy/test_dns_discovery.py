"""DNS discovery against a real DNS server on 127.0.0.1 (dnslib): records added and removed at run time move
requests to the nodes that exist, with no proxy restart (how a Kubernetes headless Service scales a pool)."""

from __future__ import annotations

import argparse
import asyncio
import socket

import aiohttp
import pytest

from hybridpd.proxy.app import PROXY_KEY
from hybridpd.proxy.config import DnsSource, Role, RoutingPolicy, Upstream
from hybridpd.proxy.discovery import DnsDiscovery, DnsResolver
from hybridpd.proxy.main import add_arguments, config_from_args
from hybridpd.proxy.routing import Router

from .conftest import proxy_config, serve_proxy
from .dns_server import LocalDns
from .fake_node import FakeNode

NAME = "decode.pool.test"
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
WAIT_ROUNDS = 200  # rounds of 50 ms at most while discovery catches up (bounded; never a timed assertion)


@pytest.fixture
def dns():
    with LocalDns() as server:
        yield server


def _port_free_on_every_host() -> int:
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((HOSTS[0], 0))
            port = probe.getsockname()[1]
        try:
            for host in HOSTS[1:]:
                with socket.socket() as other:
                    other.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on every test host")


@pytest.mark.parametrize("records, expected", [
    ({NAME: ["127.0.0.3", "127.0.0.2"]}, ("127.0.0.2", "127.0.0.3")),
    ({NAME: []}, ()),                      # the name exists, no address: an empty pool
    ({}, ()),                              # NXDOMAIN: an empty pool
])
async def test_discovery_sets_the_pool_to_the_records(dns, records, expected):
    for name, addresses in records.items():
        dns.set(name, addresses)
    router = Router((Upstream(role=Role.DECODE, host="10.9.9.9", port=8200),), RoutingPolicy.ROUND_ROBIN)
    discovery = DnsDiscovery(DnsSource(role=Role.DECODE, name=NAME, port=8200), router,
                             DnsResolver(("127.0.0.1", dns.port), timeout=2.0))
    await discovery.refresh()
    assert tuple(u.host for u in router.upstreams) == expected
    assert all(u.port == 8200 and u.role is Role.DECODE for u in router.upstreams)


async def test_an_unanswering_resolver_keeps_the_last_pool():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:  # bound, never answers
        silent.bind(("127.0.0.1", 0))
        known = (Upstream(role=Role.DECODE, host="127.0.0.2", port=8200),)
        router = Router(known, RoutingPolicy.ROUND_ROBIN)
        discovery = DnsDiscovery(DnsSource(role=Role.DECODE, name=NAME, port=8200), router,
                                 DnsResolver(("127.0.0.1", silent.getsockname()[1]), timeout=0.3))
        await discovery.refresh()
    assert router.upstreams == known


async def _wait_for_pool(session, url: str, hosts: set[str]) -> None:
    for _ in range(WAIT_ROUNDS):
        async with session.get(url + "/health") as answer:
            listed = {u["address"].rsplit(":", 1)[0] for u in (await answer.json())["upstreams"] if u["role"] == "decode"}
        if listed == hosts:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the proxy's decode pool never became {hosts}")


async def test_nodes_join_and_leave_through_dns(dns):
    port = _port_free_on_every_host()
    decoders = {host: FakeNode() for host in HOSTS}
    prefill = FakeNode()
    await prefill.start()
    for host, node in decoders.items():
        await node.start(host, port)
    dns.set(NAME, ["127.0.0.2", "127.0.0.3"])
    config = proxy_config([
        "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(prefill.port),
        "--decoder-dns", f"{NAME}:{port}", "--dns-server", f"127.0.0.1:{dns.port}", "--dns-interval", "0.1",
    ])
    assert config.decoders == () and config.decode_dns == DnsSource(role=Role.DECODE, name=NAME, port=port)
    runner, url = await serve_proxy(config)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    try:
        async with aiohttp.ClientSession() as session:
            await _wait_for_pool(session, url, {"127.0.0.2", "127.0.0.3"})  # resolved before the first answer
            for _ in range(4):
                async with session.post(url + "/v1/completions", json=body) as answer:
                    assert answer.status == 200
            assert [len(decoders[h].received) for h in HOSTS] == [2, 2, 0]

            dns.set(NAME, ["127.0.0.3", "127.0.0.4"])   # scale: one node leaves, one joins
            await _wait_for_pool(session, url, {"127.0.0.3", "127.0.0.4"})
            for _ in range(4):
                async with session.post(url + "/v1/completions", json=body) as answer:
                    assert answer.status == 200
            assert [len(decoders[h].received) for h in HOSTS] == [2, 4, 2]

            dns.set(NAME, [])                            # scaled to zero: a clear 503, not a hang or a 500
            await _wait_for_pool(session, url, set())
            async with session.post(url + "/v1/completions", json=body) as answer:
                assert answer.status == 503
                error = (await answer.json())["error"]
                assert error["code"] == 503 and "no decode node known" in error["message"]
            assert not runner.app[PROXY_KEY].routers[Role.DECODE].upstreams
    finally:
        await runner.cleanup()
        for node in (prefill, *decoders.values()):
            await node.stop()


@pytest.mark.parametrize("argv, message", [
    (["--decoder-dns", "pool:8200", "--decoder-hosts", "a"], "exclusive"),
    (["--decoder-dns", "pool"], "NAME:PORT"),
    (["--decoder-dns", "pool:99999"], "port out of range"),
    (["--dns-server", "localhost"], "HOST:PORT"),
    (["--decoder-dns", "pool:8200", "--dns-interval", "0"], "dns-interval must be positive"),
])
def test_bad_discovery_flags(argv, message):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match=message):
        config_from_args(parser.parse_args(argv))
