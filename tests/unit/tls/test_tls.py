"""TLS on the side channel and on a node's HTTP server, with throwaway certificates: a peer with a certificate from
the cluster's CA gets through, one without a certificate or with another CA's is refused; and the flags' errors."""

from __future__ import annotations

import argparse
import ssl
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from hybridpd.connector.side_channel_client import SideChannelClient
from hybridpd.connector.side_channel_server import SideChannelServer
from hybridpd.errors import KVTransferError
from hybridpd.tls import TLSConfig, add_tls_arguments
from tests.tls_certs import CertFiles, CertificateAuthority
from tests.unit.connector.test_side_channel import FakeHandler


def _config(files: CertFiles | None, *, ca: Path | None | str = "same") -> TLSConfig:
    parser = argparse.ArgumentParser()
    add_tls_arguments(parser)
    argv = []
    if files is not None:
        argv += ["--tls-cert", str(files.cert), "--tls-key", str(files.key)]
        ca_path = files.ca if ca == "same" else ca
        if ca_path is not None:
            argv += ["--tls-ca", str(ca_path)]
    config = TLSConfig.from_args(parser.parse_args(argv))
    assert config is not None
    return config


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    cluster, other = CertificateAuthority(directory, "cluster-ca"), CertificateAuthority(directory, "other-ca")
    return {"node": cluster.issue("node"), "client": cluster.issue("client"), "stranger": other.issue("stranger")}


async def _side_channel(server_tls: TLSConfig):
    server = SideChannelServer(FakeHandler(), "127.0.0.1", 0, None, credentials=server_tls.grpc_server_credentials())
    await server.start()
    return server


async def test_side_channel_over_mutual_tls(pki):
    server = await _side_channel(_config(pki["node"]))
    try:
        client = SideChannelClient("127.0.0.1", server.port, None, timeout_s=5,
                                   credentials=_config(pki["client"]).grpc_channel_credentials())
        assert (await client.get_metadata("decode")).engine_id == "prefill-0"
        await client.close()
    finally:
        await server.stop(0)


@pytest.mark.parametrize("who", ["plaintext", "stranger"])
async def test_side_channel_refuses_a_peer_without_a_valid_certificate(pki, who):
    server = await _side_channel(_config(pki["node"]))
    try:
        if who == "plaintext":
            credentials = None
        else:  # its own CA's certificate, trusting the cluster's CA for the server: the server refuses it
            stranger = pki["stranger"]
            credentials = _config(CertFiles(stranger.cert, stranger.key, pki["node"].ca)).grpc_channel_credentials()
        client = SideChannelClient("127.0.0.1", server.port, None, timeout_s=5, credentials=credentials)
        with pytest.raises(KVTransferError, match="unreachable|error"):
            await client.get_metadata("decode")
        await client.close()
    finally:
        await server.stop(0)


async def _https_server(tls: TLSConfig):
    app = web.Application()
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app.add_routes([web.get("/health", health)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls.server_context())
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"https://127.0.0.1:{port}/health"


async def test_https_with_mutual_tls(pki):
    runner, url = await _https_server(_config(pki["node"]))
    try:
        connector = aiohttp.TCPConnector(ssl=_config(pki["client"]).client_context())
        async with aiohttp.ClientSession(connector=connector) as session:
            async with session.get(url) as response:
                assert response.status == 200
        plain = ssl.create_default_context(cafile=str(pki["node"].ca))  # trusts the server, has no certificate
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=plain)) as session:
            with pytest.raises(aiohttp.ClientError):
                async with session.get(url) as response:
                    await response.read()
        stranger = pki["stranger"]
        wrong = _config(CertFiles(stranger.cert, stranger.key, pki["node"].ca)).client_context()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=wrong)) as session:
            with pytest.raises(aiohttp.ClientError):
                async with session.get(url) as response:
                    await response.read()
    finally:
        await runner.cleanup()


async def test_a_client_checks_the_server_against_the_ca(pki):
    stranger = pki["stranger"]
    runner, url = await _https_server(_config(CertFiles(stranger.cert, stranger.key, stranger.ca)))
    try:
        connector = aiohttp.TCPConnector(ssl=_config(pki["client"]).client_context())
        async with aiohttp.ClientSession(connector=connector) as session:
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                async with session.get(url) as response:
                    await response.read()
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("argv, message", [
    (["--tls-cert", "{cert}"], "go together"),
    (["--tls-key", "{key}"], "go together"),
    (["--tls-ca", "{ca}"], "needs --tls-cert"),
    (["--tls-cert", "{cert}", "--tls-key", "/nonexistent/key.pem"], "cannot read --tls-key"),
    (["--tls-cert", "{key}", "--tls-key", "{key}"], "cannot use"),
])
def test_bad_flags_say_what_is_wrong(pki, argv, message):
    files = pki["node"]
    parser = argparse.ArgumentParser()
    add_tls_arguments(parser)
    args = parser.parse_args([a.format(cert=files.cert, key=files.key, ca=files.ca) for a in argv])
    with pytest.raises(ValueError, match=message):
        TLSConfig.from_args(args)


def _no_ca(files: CertFiles, *extra: str) -> TLSConfig:
    parser = argparse.ArgumentParser()
    add_tls_arguments(parser)
    config = TLSConfig.from_args(parser.parse_args(["--tls-cert", str(files.cert), "--tls-key", str(files.key),
                                                    *extra]))
    assert config is not None
    return config


@pytest.mark.parametrize("server, insecure, accepted", [
    ("node", False, True),         # the cluster's shared certificate: verified against itself
    ("stranger", False, False),    # a man in the middle with a certificate of his own: refused
    ("stranger", True, True),      # --tls-insecure: encryption only, anyone is accepted
])
async def test_without_a_ca_clients_still_verify_the_server_unless_told_not_to(pki, server, insecure, accepted):
    files = pki[server]
    runner, url = await _https_server(_no_ca(files))
    try:
        client = _no_ca(pki["node"], *(["--tls-insecure"] if insecure else []))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=client.client_context())) as session:
            if accepted:
                async with session.get(url) as response:
                    assert response.status == 200
            else:
                with pytest.raises(aiohttp.ClientConnectorCertificateError):
                    async with session.get(url) as response:
                        await response.read()
    finally:
        await runner.cleanup()


def test_tls_insecure_with_a_ca_or_without_tls_is_refused(pki):
    files = pki["node"]
    parser = argparse.ArgumentParser()
    add_tls_arguments(parser)
    with pytest.raises(ValueError, match="contradict"):
        TLSConfig.from_args(parser.parse_args(["--tls-cert", str(files.cert), "--tls-key", str(files.key),
                                               "--tls-ca", str(files.ca), "--tls-insecure"]))
    with pytest.raises(ValueError, match="needs --tls-cert"):
        TLSConfig.from_args(parser.parse_args(["--tls-insecure"]))
