"""`LocalCluster`: N prefill + M decode `hybridpd serve` processes and a proxy, as a context manager.

    with LocalCluster(ClusterSpec(num_prefill=1, num_decode=1, model_dir=path)) as info:
        post(info.proxy_url + "/v1/completions", ...)

Lifecycle: SPAWN nodes -> wait until every node's /health is 200 -> SPAWN proxy -> wait for its /health
-> RUNNING -> STOPPED (proxy first, then nodes; SIGTERM, then SIGKILL after the grace). Any failure on
the way (a child exits, the deadline passes, a stop is requested) stops every child already started
before the error leaves `start()`, so no process is ever left behind.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from hybridpd.launcher.errors import ChildExitedError, StartupInterruptedError, StartupTimeoutError
from hybridpd.launcher.process import ChildProcess
from hybridpd.launcher.spec import EVENTS_PORT_OFFSET, REPLAY_PORT_OFFSET, ClusterInfo, ClusterSpec, NodeInfo
from hybridpd.proxy.config import Role

_POLL_SECONDS = 0.2
_PROBE_TIMEOUT = 2.0
# The proxy probes every node's /health each second, and this launcher polls them too: kept out of the access logs
# (a flag given in serve_args or proxy_args comes later and wins).
_QUIET_ACCESS_LOG = ("--disable-access-log-for-endpoints", "/health,/metrics")


def _connect_host(host: str) -> str:
    """Where to reach a server that listens on `host` (a wildcard address is reached on loopback)."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)


def _url(host: str, port: int) -> str:
    host = _connect_host(host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=_PROBE_TIMEOUT) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class LocalCluster:
    def __init__(self, spec: ClusterSpec, stop_requested: threading.Event | None = None) -> None:
        """`stop_requested` (set by a signal handler, say) aborts a startup in progress."""
        self.spec = spec
        self._stop_requested = stop_requested or threading.Event()
        self._children: list[ChildProcess] = []
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.info: ClusterInfo | None = None

    def __enter__(self) -> ClusterInfo:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def children(self) -> tuple[ChildProcess, ...]:
        return tuple(self._children)

    def _serve_argv(self, port: int, kv_port: int) -> list[str]:
        argv = [self.spec.python, "-m", "hybridpd", "serve"]
        if self.spec.model_dir is not None:
            argv.append(str(self.spec.model_dir))
        argv += ["--host", self.spec.host, "--port", str(port), "--kv-port", str(kv_port),
                 "--threads", str(self.spec.threads), *_QUIET_ACCESS_LOG]
        if self.spec.kv_events:
            offset = port - self.spec.base_port
            # the node binds these wildcards on its own --host (hybridpd/kv_events/config.py: listen_endpoint)
            argv += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"tcp://*:{self.spec.base_port + EVENTS_PORT_OFFSET + offset}",
                "replay_endpoint": f"tcp://*:{self.spec.base_port + REPLAY_PORT_OFFSET + offset}",
                "topic": "kv-events",
            })]
        return argv + list(self.spec.serve_args)

    def _proxy_argv(self, nodes: tuple[NodeInfo, ...]) -> list[str]:
        prefill = [n for n in nodes if n.role is Role.PREFILL]
        decode = [n for n in nodes if n.role is Role.DECODE]
        host = _connect_host(self.spec.host)
        return [
            self.spec.python, "-m", "hybridpd.proxy", "--host", self.spec.host, "--port", str(self.spec.port),
            "--prefiller-hosts", *[host] * len(prefill), "--prefiller-ports", *[str(n.port) for n in prefill],
            "--decoder-hosts", *[host] * len(decode), "--decoder-ports", *[str(n.port) for n in decode],
            *_QUIET_ACCESS_LOG, *self.spec.proxy_args,
        ]

    def _spawn(self, name: str, argv: list[str], run_dir: Path) -> ChildProcess:
        child = ChildProcess(name, argv, run_dir / f"{name}.log", self._env)
        self._children.append(child)
        return child

    def _wait_healthy(self, pending: dict[str, ChildProcess], deadline: float) -> None:
        """Polls each URL until 200; fails fast when a child exits, the deadline passes or a stop is asked."""
        while pending:
            for url, child in list(pending.items()):
                code = child.returncode()
                if code is not None:
                    raise ChildExitedError(child.name, code, child.log_path, child.log_tail())
                if _healthy(url):
                    del pending[url]
            if not pending:
                return
            if time.monotonic() > deadline:
                url, child = next(iter(pending.items()))
                raise StartupTimeoutError(child.name, url, self.spec.startup_timeout, child.log_path,
                                          child.log_tail())
            if self._stop_requested.wait(_POLL_SECONDS):
                raise StartupInterruptedError("stop requested while the cluster was starting")

    def start(self) -> ClusterInfo:
        if self._children:
            raise RuntimeError("this LocalCluster was already started")
        run_dir = self.spec.run_dir or Path(tempfile.mkdtemp(prefix="hybridpd-up-"))
        run_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.spec.startup_timeout
        try:
            nodes = []
            for name, role, port, kv_port in self.spec.nodes():
                child = self._spawn(name, self._serve_argv(port, kv_port), run_dir)
                nodes.append(NodeInfo(name=name, role=role, url=_url(self.spec.host, port), port=port,
                                      kv_port=kv_port, pid=child.pid, log_path=child.log_path))
            self._wait_healthy({node.url: child for node, child in zip(nodes, self._children)}, deadline)
            proxy = self._spawn("proxy", self._proxy_argv(tuple(nodes)), run_dir)
            proxy_url = _url(self.spec.host, self.spec.port)
            self._wait_healthy({proxy_url: proxy}, deadline)
        except BaseException:
            self.stop()
            raise
        self.info = ClusterInfo(
            proxy_url=proxy_url, proxy_pid=proxy.pid, proxy_log_path=proxy.log_path,
            prefill=tuple(n for n in nodes if n.role is Role.PREFILL),
            decode=tuple(n for n in nodes if n.role is Role.DECODE), run_dir=run_dir,
        )
        return self.info

    def respawn(self, child: ChildProcess) -> ChildProcess:
        """Start `child` again (same name, argv, environment and log file, appended) in its place."""
        again = ChildProcess(child.name, child.argv, child.log_path, self._env)
        self._children[self._children.index(child)] = again
        return again

    def check_alive(self) -> None:
        """Raises ChildExitedError naming the first child that is no longer running."""
        for child in self._children:
            code = child.returncode()
            if code is not None:
                raise ChildExitedError(child.name, code, child.log_path, child.log_tail())

    def stop(self) -> None:
        """SIGTERM to every child (the proxy first), SIGKILL to any still alive after the grace. Idempotent."""
        for child in reversed(self._children):
            child.terminate()
        deadline = time.monotonic() + self.spec.stop_grace
        for child in reversed(self._children):
            child.finish(deadline)
