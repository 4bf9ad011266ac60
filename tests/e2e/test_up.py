"""`hybridpd up` as a real process: a child that fails to start, and a real 1P+1D cluster stopped by SIGTERM.
Its engine, LocalCluster, with stand-in nodes: a fake interpreter runs a tiny HTTP node for
`-m hybridpd serve` and the real proxy for everything else (start, health wait, traffic, a child's
death, a startup timeout and the final stop, in a few seconds).

Every test finds its children by their unique `--port N` arguments in /proc (nothing else on the machine
uses those ports), and kills whatever is left in a `finally`, so a failing test leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridpd.launcher.cluster import LocalCluster
from hybridpd.launcher.errors import ChildExitedError, StartupTimeoutError
from hybridpd.launcher.ports import free_cluster_ports
from hybridpd.launcher.spec import ClusterSpec
from hybridpd.launcher.supervisor import RestartPolicy, Supervisor
from tests.e2e.nodes import make_tiny_checkpoint

STARTUP_DEADLINE = 240.0  # seconds for a real cluster on 2 busy cores
EXIT_DEADLINE = 60.0


def _pids_with_args(needle: list[str]) -> list[int]:
    """PIDs of live processes whose argv contains `needle` as consecutive arguments."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv]
        if state != "Z" and any(words[i:i + len(needle)] == needle for i in range(len(words))):
            found.append(int(entry.name))
    return found


def _children(ports: list[int]) -> list[int]:
    return sorted({pid for port in ports for pid in _pids_with_args(["--port", str(port)])})


def _kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(EXIT_DEADLINE)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def cluster_ports() -> Iterator[tuple[int, int]]:
    proxy_port, base_port = free_cluster_ports(2)
    ports = [proxy_port, base_port, base_port + 1]
    try:
        yield proxy_port, base_port
    finally:
        _kill_leftovers(_children(ports))


def test_up_with_a_bad_model_dir_exits_nonzero_and_leaves_nothing(tmp_path, cluster_ports):
    proxy_port, base_port = cluster_ports
    result = subprocess.run(
        [sys.executable, "-m", "hybridpd.up", "--model", str(tmp_path / "no-such-model"),
         "--port", str(proxy_port), "--base-port", str(base_port), "--run-dir", str(tmp_path / "run"),
         "--startup-timeout", "120", "--stop-grace", "5"],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 1
    assert "hybridpd up: error:" in result.stderr
    assert "exited with code" in result.stderr
    assert "prefill-0" in result.stderr or "decode-0" in result.stderr
    assert "last lines of" in result.stderr and str(tmp_path / "run") in result.stderr
    assert _children([proxy_port, base_port, base_port + 1]) == []
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["decode-0.log", "prefill-0.log"]


@pytest.mark.parametrize("argv, message", [
    (["--prefill", "0"], "--prefill and --decode must be >= 1"),
    (["--port", "8100", "--base-port", "8100"], "collides with a node port"),
    (["--base-port", "65000"], "leaves no room"),
])
def test_up_rejects_bad_flags_with_exit_2(argv, message):
    result = subprocess.run([sys.executable, "-m", "hybridpd.up", *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    out = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-model"))
    return out


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


class _Output:
    """A child's stdout read by a thread, line by line, so the test can wait for a line with a deadline."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=lambda: self.lines.extend(iter(process.stdout.readline, "")),
                                        daemon=True)
        self._thread.start()

    def wait_for(self, marker: str, deadline: float) -> None:
        while not any(marker in line for line in list(self.lines)):
            assert self._thread.is_alive(), f"the process ended before printing `{marker}`:\n{self.text()}"
            assert time.monotonic() < deadline, f"`{marker}` never printed:\n{self.text()}"
            time.sleep(0.1)  # a poll interval under a deadline, not a synchronisation

    def text(self, timeout: float = 0.0) -> str:
        self._thread.join(timeout)
        return "".join(self.lines)


def test_up_serves_through_the_proxy_and_sigterm_leaves_no_child(tmp_path, cluster_ports, tiny_checkpoint):
    proxy_port, base_port = cluster_ports
    up = subprocess.Popen(
        [sys.executable, "-m", "hybridpd", "up", "--prefill", "1", "--decode", "1", "--model", str(tiny_checkpoint),
         "--port", str(proxy_port), "--base-port", str(base_port), "--run-dir", str(tmp_path / "run"),
         "--stop-grace", "10"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    output_reader = _Output(up)
    try:
        deadline = time.monotonic() + STARTUP_DEADLINE
        while _get(f"http://127.0.0.1:{proxy_port}/health")[0] != 200:
            assert up.poll() is None, f"up exited early:\n{output_reader.text(timeout=5)}"
            assert time.monotonic() < deadline, "the cluster did not become healthy in time"
            time.sleep(0.5)  # a poll interval under a deadline, not a synchronisation
        body = json.dumps({"prompt": "hello hybrid world", "max_tokens": 4, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{proxy_port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        assert answer["choices"][0]["finish_reason"] in ("length", "stop")
        assert answer["usage"]["completion_tokens"] >= 1
        children = _children([proxy_port, base_port, base_port + 1])
        assert len(children) == 4  # up itself (its --port) + 2 nodes + the proxy
        # `up` counts as started once it says so (its own health wait may still be polling the proxy): a SIGTERM
        # before that is an interrupted start-up (exit 130), not the clean stop this test is about
        output_reader.wait_for("Press Ctrl-C to stop.", deadline)
        up.send_signal(signal.SIGTERM)
        assert up.wait(EXIT_DEADLINE) == 0
        output = output_reader.text(timeout=EXIT_DEADLINE)
        assert f"http://127.0.0.1:{proxy_port}" in output and f"http://127.0.0.1:{base_port}/metrics" in output
        assert _children([proxy_port, base_port, base_port + 1]) == []
    finally:
        _stop(up)


FAKE_INTERPRETER = textwrap.dedent('''\
    #!{python}
    """Stands in for python: `-m hybridpd serve ... --port P` runs a tiny node; anything else runs for real."""
    import os, sys
    args = sys.argv[1:]
    if args[:3] != ["-m", "hybridpd", "serve"]:
        os.execv({python!r}, [{python!r}, *args])
    from aiohttp import web
    port = int(args[args.index("--port") + 1])
    healthy = "--never-healthy" not in args

    async def generate(request):
        body = await request.json()
        if (body.get("kv_transfer_params") or {{}}).get("do_remote_decode"):
            return web.json_response({{"kv_transfer_params": {{"do_remote_prefill": True, "from": port}}}})
        return web.json_response({{"choices": [{{"text": "ok"}}], "params": body.get("kv_transfer_params")}})

    async def health(request):
        return web.Response(status=200 if healthy else 503)

    app = web.Application()
    app.router.add_post("/v1/completions", generate)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None)
''')


@pytest.fixture
def fake_python(tmp_path) -> str:
    path = tmp_path / "fake-python"
    path.write_text(FAKE_INTERPRETER.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _spec(fake_python: str, tmp_path: Path, **overrides) -> ClusterSpec:
    proxy_port, base_port = free_cluster_ports(2)
    settings = dict(num_prefill=1, num_decode=1, port=proxy_port, base_port=base_port, python=fake_python,
                    run_dir=tmp_path / "run", startup_timeout=60.0, stop_grace=5.0)
    settings.update(overrides)
    return ClusterSpec(**settings)


def test_cluster_serves_through_the_proxy_and_reports_a_dead_child(fake_python, tmp_path):
    cluster = LocalCluster(_spec(fake_python, tmp_path))
    try:
        info = cluster.start()
        request = urllib.request.Request(info.proxy_url + "/v1/completions", data=b'{"prompt": "x"}',
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            answer = json.loads(response.read())
        assert answer["params"] == {"do_remote_prefill": True, "from": info.prefill[0].port}
        cluster.check_alive()
        os.kill(info.decode[0].pid, signal.SIGKILL)
        os.waitid(os.P_PID, info.decode[0].pid, os.WEXITED | os.WNOWAIT)
        with pytest.raises(ChildExitedError, match="decode-0 exited with code -9"):
            cluster.check_alive()
    finally:
        cluster.stop()
    assert [pid for pid in info.pids if _alive(pid)] == []
    assert sorted(p.name for p in info.run_dir.iterdir()) == ["decode-0.log", "prefill-0.log", "proxy.log"]


def test_a_node_that_never_gets_healthy_times_out_and_is_stopped(fake_python, tmp_path):
    cluster = LocalCluster(_spec(fake_python, tmp_path, serve_args=("--never-healthy",), startup_timeout=3.0))
    with pytest.raises(StartupTimeoutError, match="prefill-0 was not healthy"):
        cluster.start()
    assert cluster.children and [c.name for c in cluster.children if c.returncode() is None] == []


def test_a_node_that_dies_after_start_up_is_restarted_and_serves_again(fake_python, tmp_path):
    """`hybridpd up --restart on-failure` (the default): the supervisor notices the exit, names its cause, and
    starts the node again on the same ports; the cluster answers again through the proxy."""
    cluster = LocalCluster(_spec(fake_python, tmp_path))
    lines: list[str] = []
    try:
        info = cluster.start()
        supervisor = Supervisor(list(cluster.children), RestartPolicy.ON_FAILURE, cluster.respawn,
                                report=lines.append)
        os.kill(info.prefill[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + STARTUP_DEADLINE
        while supervisor.restarts("prefill-0") == 0 or _get(info.prefill[0].url + "/health")[0] != 200:
            assert time.monotonic() < deadline, f"prefill-0 was not restarted: {lines}"
            supervisor.check()
            time.sleep(0.1)  # a poll interval under a deadline, not a synchronisation
        assert any("prefill-0 killed by SIGKILL; restarting it" in line for line in lines), lines
        restarted = next(c for c in cluster.children if c.name == "prefill-0")
        assert restarted.pid != info.prefill[0].pid and restarted.returncode() is None
        request = urllib.request.Request(info.proxy_url + "/v1/completions", data=b'{"prompt": "x"}',
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert json.loads(response.read())["params"]["from"] == info.prefill[0].port
        pids = [c.pid for c in cluster.children]
    finally:
        cluster.stop()
    assert [pid for pid in pids if _alive(pid)] == []
