"""Security of a node and the proxy, on real processes (tiny checkpoint):

- nodes, their side channel and transport, and the proxy listen on loopback unless told otherwise;
- with `--cluster-token-file`, an HTTP request that carries `kv_transfer_params` needs the token in
  `X-HybridPD-Cluster-Token` (401 otherwise) and every side-channel call needs `authorization: Bearer`
  (UNAUTHENTICATED otherwise); requests without kv_transfer_params need nothing;
- nodes that share a token do P/D and answer like a colocated node; a decoder with another token fails the
  pull with an error that names UNAUTHENTICATED and the peer, and the prefill node frees the blocks when the
  lease expires;
- no token ever appears in a node's or the proxy's log (the proxy logs at DEBUG).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hybridpd.connector.side_channel_client import SideChannelClient
from hybridpd.presets.checkpoints import write_checkpoint
from hybridpd.errors import KVTransferError
from hybridpd.launcher.spec import ClusterSpec
from hybridpd.proxy.main import add_arguments as add_proxy_arguments
from hybridpd.wire_headers import CLUSTER_TOKEN_HEADER
from hybridpd.server.args import add_arguments as add_serve_arguments
from hybridpd.server.args import configs_from_args
from tests.e2e.nodes import NodeProcess, assert_blocks_free, free_port, start_node

LEASE_S = 4.0
NODE_ARGS = ["--num-blocks", "128", "--max-model-len", "512", "--kv-lease-seconds", str(LEASE_S),
             "--kv-load-timeout", "20"]
PROMPT = "Only nodes that share the cluster token may move this prompt's KV. " * 2
BODY = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


@dataclass(frozen=True, kw_only=True)
class Secured:
    token: str
    other_token: str
    prefill: NodeProcess
    decode: NodeProcess          # same token as prefill
    stranger: NodeProcess        # another token
    proxy_log: Path
    proxy_pid: int
    proxy_url: str

    @property
    def logs(self) -> list[Path]:
        return [self.prefill.log_path, self.decode.log_path, self.stranger.log_path, self.proxy_log]


def _token_file(directory: Path, name: str) -> tuple[str, Path]:
    token = f"tok-{uuid.uuid4().hex}"
    path = directory / name
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token, path


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answers (a 503 only says an upstream is not ready)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout:g} s")


@pytest.fixture(scope="module")
def secured(tmp_path_factory) -> Iterator[Secured]:
    model = write_checkpoint("tiny", tmp_path_factory.mktemp("model"))
    logs = tmp_path_factory.mktemp("logs")
    token, token_path = _token_file(logs, "token")
    other_token, other_path = _token_file(logs, "other-token")
    started: list[NodeProcess] = []
    proxy: subprocess.Popen | None = None
    try:
        for name, path in (("prefill", token_path), ("decode", token_path), ("stranger", other_path)):
            started.append(start_node(model, logs, [*NODE_ARGS, "--cluster-token-file", str(path)], name=name))
        prefill, decode, stranger = started
        port = free_port()
        proxy_log = logs / "proxy.log"
        with open(proxy_log, "wb") as out:  # no --host: the default must be loopback
            proxy = subprocess.Popen(
                [sys.executable, "-m", "hybridpd", "proxy", "--port", str(port), "--log-level", "DEBUG",
                 "--cluster-token-file", str(token_path), "--prefiller-hosts", "127.0.0.1", "--prefiller-ports",
                 str(prefill.port), "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(decode.port)],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        proxy_url = f"http://127.0.0.1:{port}"
        _wait_healthy(proxy_url, proxy, proxy_log)
        yield Secured(token=token, other_token=other_token, prefill=prefill, decode=decode, stranger=stranger,
                      proxy_log=proxy_log, proxy_pid=proxy.pid, proxy_url=proxy_url)
    finally:
        if proxy is not None and proxy.poll() is None:
            proxy.kill()
            proxy.wait(timeout=10)
        for node in started:
            node.kill()


# -- listening addresses ------------------------------------------------------------------------------------------

def _hex_address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} prints it (32-bit words in host byte order, little-endian here)."""
    raw = bytes.fromhex(text)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket the process listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.append((str(_hex_address(address)), int(port, 16)))
    return found


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return (mapped or ip).is_loopback


def _parsed(add_arguments, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("parse, host_of", [
    (lambda: configs_from_args(_parsed(add_serve_arguments, []), lambda: Path("m")),
     lambda configs: (configs.server.host, configs.kv_transfer.kv_host)),
    (lambda: _parsed(add_proxy_arguments, []), lambda args: (args.host,)),
    (lambda: ClusterSpec(), lambda spec: (spec.host,)),
])
def test_defaults_bind_loopback(parse, host_of):
    assert set(host_of(parse())) == {"127.0.0.1"}


def test_every_listening_socket_is_on_loopback(secured):
    """HTTP, the gRPC side channel and UCX's own listeners of each node, and the proxy started without --host."""
    for name, pid in [("prefill", secured.prefill.proc.pid), ("decode", secured.decode.proc.pid),
                      ("proxy", secured.proxy_pid)]:
        addresses = listening_addresses(pid)
        assert addresses, name
        assert all(_is_loopback(address) for address, _ in addresses), (name, addresses)


# -- the token on HTTP ---------------------------------------------------------------------------------------------

PREFILL_BODY = {**BODY, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}


@pytest.mark.parametrize("body, header, expected", [
    (PREFILL_BODY, None, 401),
    (PREFILL_BODY, "wrong", 401),
    (PREFILL_BODY, "other", 401),
    (PREFILL_BODY, "right", 200),
    (BODY, None, 200),  # no kv_transfer_params: no token needed
])
def test_kv_transfer_params_need_the_cluster_token(secured, body, header, expected):
    value = {"wrong": "x" * len(secured.token), "other": secured.other_token, "right": secured.token}.get(header)
    headers = {} if value is None else {CLUSTER_TOKEN_HEADER: value}
    status, answer = secured.prefill.post_json("/v1/completions", body, headers=headers)
    assert status == expected, answer
    if expected == 401:
        assert answer["error"]["type"] == "authentication_error"
        assert CLUSTER_TOKEN_HEADER in answer["error"]["message"]
        assert secured.token not in str(answer) and secured.other_token not in str(answer)


# -- the token on the side channel ---------------------------------------------------------------------------------

async def _metadata(port: int, token: str | None) -> str:
    client = SideChannelClient("127.0.0.1", port, cluster_token=token, timeout_s=10.0)
    try:
        return (await client.get_metadata("test")).engine_id
    finally:
        await client.close()


@pytest.mark.parametrize("which, allowed", [(None, False), ("other", False), ("right", True)])
def test_side_channel_needs_the_cluster_token(secured, which, allowed):
    token = {"other": secured.other_token, "right": secured.token}.get(which)
    if allowed:
        assert asyncio.run(_metadata(secured.prefill.kv_port, token)).startswith("hybridpd-")
        return
    with pytest.raises(KVTransferError, match="UNAUTHENTICATED") as failure:
        asyncio.run(_metadata(secured.prefill.kv_port, token))
    assert secured.token not in str(failure.value)


def test_side_channel_health_needs_no_token(secured):
    with grpc.insecure_channel(f"127.0.0.1:{secured.prefill.kv_port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


# -- P/D with the same and with another token ----------------------------------------------------------------------

def _prefill(secured: Secured) -> dict:
    status, answer = secured.prefill.post_json("/v1/completions", PREFILL_BODY,
                                               headers={CLUSTER_TOKEN_HEADER: secured.token})
    assert status == 200, answer
    return answer["kv_transfer_params"]


def test_nodes_sharing_the_token_do_pd_like_colocated(secured):
    # the colocated reference comes from another node, before the P/D run: never from the node under test's cache
    status, local = secured.stranger.post_json("/v1/completions", BODY)
    assert status == 200, local
    params = _prefill(secured)
    status, remote = secured.decode.post_json("/v1/completions", {**BODY, "kv_transfer_params": params},
                                              headers={CLUSTER_TOKEN_HEADER: secured.token})
    assert status == 200, remote
    assert remote["choices"][0]["token_ids"] == local["choices"][0]["token_ids"] != []


def test_a_decoder_with_another_token_fails_the_pull_clearly(secured):
    params = _prefill(secured)
    status, answer = secured.stranger.post_json("/v1/completions", {**BODY, "kv_transfer_params": params},
                                                headers={CLUSTER_TOKEN_HEADER: secured.other_token})
    assert status == 502, answer
    message = answer["error"]["message"]
    assert "UNAUTHENTICATED" in message and f"127.0.0.1:{secured.prefill.kv_port}" in message, message
    assert secured.token not in message and secured.other_token not in message
    # the stranger could not release the lease either: it expires, and the prefill node frees the blocks
    assert_blocks_free(secured.prefill, timeout=LEASE_S * 10)
    assert_blocks_free(secured.stranger)
    assert secured.prefill.metric_values("hybridpd:kv_leases_held") == {"": 0.0}


# -- logs ----------------------------------------------------------------------------------------------------------

def test_no_token_in_any_log(secured):
    """Runs last in this module: every request above has been logged by now. One more goes through the proxy
    (which logs at DEBUG) so that its forwarding path is in its log too, whatever its answer."""
    request = urllib.request.Request(secured.proxy_url + "/v1/completions", data=json.dumps(BODY).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=120).read()
    except urllib.error.HTTPError:
        pass
    for log in secured.logs:
        text = log.read_text(errors="replace")
        assert text, log
        assert secured.token not in text and secured.other_token not in text, log
