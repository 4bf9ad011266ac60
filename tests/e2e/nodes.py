"""Start real `hybridpd serve` processes on 127.0.0.1 for end-to-end tests, and always tear them down."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

STARTUP_TIMEOUT_S = 120.0


def make_tiny_checkpoint(out: Path) -> Path:
    """The tiny preset written by the CLI a user would run (`hybridpd make-checkpoint`), into `out`."""
    subprocess.run([sys.executable, "-m", "hybridpd", "make-checkpoint", "--preset", "tiny", "--out", str(out)],
                   check=True, timeout=300)
    return out


def terminate(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if the process has not exited after a grace."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it: a node is its HTTP front and its engine process."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    return tree


def signal_tree(pid: int, sig: signal.Signals) -> None:
    """Send `sig` to a node's every process (SIGSTOP freezes the whole node, as a frozen host would)."""
    for member in process_tree(pid):
        try:
            os.kill(member, sig)
        except ProcessLookupError:
            pass


def tree_rss_kib(pid: int) -> int:
    """Resident memory (VmRSS) of `pid` and its processes below, summed."""
    total = 0
    for member in process_tree(pid):
        for line in Path(f"/proc/{member}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total


# Below Linux's ephemeral range (32768-60999): a port the OS hands out for an outgoing connection (there are many
# in this suite) can never collide with one chosen here between the check and the node's bind.
_PORT_LOW, _PORT_HIGH = 20000, 32767
_PORTS = random.Random()


def free_port() -> int:
    """A port nobody listens on now, outside the ephemeral range (bound, then released)."""
    for _ in range(200):
        port = _PORTS.randrange(_PORT_LOW, _PORT_HIGH)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class NodeProcess:
    proc: subprocess.Popen
    port: int
    kv_port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def get_json(self, path: str, timeout: float = 10.0) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:
            return json.loads(resp.read())

    def post_json(self, path: str, body: dict, timeout: float = 120.0, headers: dict | None = None) -> tuple[int, dict]:
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            return resp.read().decode()

    def metric_values(self, name: str) -> dict[str, float]:
        """{label string: value} of every sample of `name` (exact name, labels as printed)."""
        out = {}
        for line in self.metrics().splitlines():
            m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", line)
            if m:
                out[m.group(1) or ""] = float(m.group(2))
        return out

    def stop(self) -> None:
        terminate(self.proc)

    def kill(self) -> None:
        kill(self.proc)


_BIND_FAILED = ("Failed to bind", "address already in use", "Address already in use")


def start_node(model_dir: Path, log_dir: Path, args: Sequence[str] = (), *, name: str = "node") -> NodeProcess:
    """Start a node on free ports; if another process took one of them first (the node's log says it could not
    bind), try once more on other ports."""
    try:
        return _start_node(model_dir, log_dir, args, name=name)
    except NodeStartError as exc:
        if not any(marker in exc.log_tail for marker in _BIND_FAILED):
            raise
        return _start_node(model_dir, log_dir, args, name=name)


class NodeStartError(RuntimeError):
    def __init__(self, message: str, log_tail: str) -> None:
        super().__init__(message)
        self.log_tail = log_tail


def _start_node(model_dir: Path, log_dir: Path, args: Sequence[str], *, name: str) -> NodeProcess:
    port, kv_port = free_port(), free_port()
    log_path = log_dir / f"{name}-{port}.log"
    cmd = [sys.executable, "-m", "hybridpd", "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--kv-port", str(kv_port), "--threads", "1", *args]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log.close()
    node = NodeProcess(proc, port, kv_port, log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = node.log_tail()
            raise NodeStartError(f"{name} exited with {proc.returncode} during start-up:\n{tail}", tail)
        try:
            with urllib.request.urlopen(node.url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return node
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    node.kill()
    raise RuntimeError(f"{name} did not become healthy in {STARTUP_TIMEOUT_S:.0f} s:\n{node.log_tail()}")


def assert_blocks_free(node: NodeProcess, timeout: float = 10.0) -> None:
    """Every block not held by the prefix cache is free: free == total in every group (cached blocks count as
    free: they are evictable). Polls briefly: a just-finished request's blocks are freed on the engine thread."""
    deadline = time.monotonic() + timeout
    while True:
        free = node.metric_values("hybridpd:kv_free_blocks")
        total = node.metric_values("hybridpd:kv_total_blocks")
        if free and free == total:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks not back in the pool on {node.url}: free {free}, total {total}")
        time.sleep(0.1)


async def stream_completion(url: str, body: dict) -> list[dict]:
    """The events of one streamed `/v1/completions` call (a 200 expected), `{"done": True}` for its `[DONE]`."""
    events = []
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line:
                    continue
                assert line.startswith("data: ")
                if line == "data: [DONE]":
                    events.append({"done": True})
                    break
                events.append(json.loads(line[len("data: "):]))
    return events
