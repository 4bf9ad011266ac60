"""A P/D cluster with TLS on every hop (mutual, one CA): the proxy calls the nodes over HTTPS with its client
certificate, the decode node pulls over a TLS side channel; a greedy request gives the tokens of the same request
colocated on the decode node. A client without a certificate is refused by a node, and a node that does not know
the CA cannot pull from the prefill node (the side channel refuses it: a 502 naming the prefill node)."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.nodes import free_port, make_tiny_checkpoint, terminate
from tests.tls_certs import CertificateAuthority

STARTUP_S = 180.0
BODY = {"prompt": list(range(5, 60)), "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def _context(files) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(files.ca))
    context.load_cert_chain(str(files.cert), str(files.key))
    return context


def _request(url: str, context: ssl.SSLContext | None, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120, context=context) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _wait(url: str, context: ssl.SSLContext, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if _request(url + "/health", context)[0] == 200:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError, ssl.SSLError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[dict]:
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"))
    pki = tmp_path_factory.mktemp("pki")
    ca, other = CertificateAuthority(pki, "cluster-ca"), CertificateAuthority(pki, "other-ca")
    certs = {name: ca.issue(name) for name in ("prefill", "decode", "proxy", "client")}
    certs["rogue"] = other.issue("rogue")
    logs = tmp_path_factory.mktemp("logs")
    procs: list[subprocess.Popen] = []

    def spawn(name: str, argv: list[str]) -> Path:
        log = logs / f"{name}.log"
        with open(log, "wb") as out:
            procs.append(subprocess.Popen([sys.executable, "-m", "hybridpd", *argv], stdout=out,
                                          stderr=subprocess.STDOUT))
        return log

    def tls(files) -> list[str]:
        return ["--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca)]

    ports = {name: (free_port(), free_port()) for name in ("prefill", "decode", "rogue")}
    health_port = free_port()   # the decode node's plain-HTTP /health, for probes that have no certificate
    proxy_port = free_port()
    try:
        for name in ("prefill", "decode", "rogue"):
            http, kv = ports[name]
            log = spawn(name, ["serve", str(model), "--port", str(http), "--kv-port", str(kv), "--threads", "1",
                               "--kv-cache-memory", "64MiB", *tls(certs[name]),
                               *(["--health-port", str(health_port)] if name == "decode" else [])])
            _wait(f"https://127.0.0.1:{http}", _context(certs["client"] if name != "rogue" else certs["rogue"]),
                  procs[-1], log)
        log = spawn("proxy", ["proxy", "--port", str(proxy_port), "--prefiller-hosts", "127.0.0.1",
                              "--prefiller-ports", str(ports["prefill"][0]), "--decoder-hosts", "127.0.0.1",
                              "--decoder-ports", str(ports["decode"][0]), "--no-fallback-colocated",
                              *tls(certs["proxy"])])
        deadline = time.monotonic() + STARTUP_S
        while True:
            try:
                if _request(f"http://127.0.0.1:{proxy_port}/health", None)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline and procs[-1].poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        yield {"certs": certs, "ports": ports, "proxy": f"http://127.0.0.1:{proxy_port}", "health_port": health_port}
    finally:
        for proc in reversed(procs):
            terminate(proc)


def test_pd_over_tls_gives_the_colocated_tokens(cluster):
    status, answer = _request(cluster["proxy"] + "/v1/completions", None, {**BODY, "return_token_ids": True})
    assert status == 200, answer
    decode = f"https://127.0.0.1:{cluster['ports']['decode'][0]}"
    status, local = _request(decode + "/v1/completions", _context(cluster["certs"]["client"]),
                             {**BODY, "return_token_ids": True})
    assert status == 200, local
    assert answer["choices"][0]["token_ids"] == local["choices"][0]["token_ids"]
    assert answer["choices"][0]["text"] == local["choices"][0]["text"]


def test_a_client_without_a_certificate_is_refused(cluster):
    files = cluster["certs"]["client"]
    no_cert = ssl.create_default_context(cafile=str(files.ca))
    url = f"https://127.0.0.1:{cluster['ports']['decode'][0]}/health"
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
        _request(url, no_cert)


def test_a_probe_without_a_certificate_reads_health_on_the_plain_health_port_and_nothing_else(cluster):
    """A kubelet cannot present a client certificate: under mutual TLS it probes `--health-port`."""
    url = f"http://127.0.0.1:{cluster['health_port']}"
    assert _request(url + "/health", None) == (200, {"status": "ok"})
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(BODY).encode(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code in (404, 405)


def test_a_node_of_another_ca_cannot_pull(cluster):
    """The rogue node (another CA) gets the prefill node's kv_transfer_params but its side channel call is refused."""
    prefill = f"https://127.0.0.1:{cluster['ports']['prefill'][0]}"
    params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
    status, held = _request(prefill + "/v1/completions", _context(cluster["certs"]["client"]),
                            {**BODY, "max_tokens": 1, "kv_transfer_params": params})
    assert status == 200, held
    rogue = f"https://127.0.0.1:{cluster['ports']['rogue'][0]}"
    status, answer = _request(rogue + "/v1/completions", _context(cluster["certs"]["rogue"]),
                              {**BODY, "kv_transfer_params": held["kv_transfer_params"]})
    assert status >= 500 and f"127.0.0.1:{cluster['ports']['prefill'][1]}" in json.dumps(answer), answer
