"""`hybridpd up`: a local cluster of N prefill + M decode nodes and a proxy, until Ctrl-C or SIGTERM.

Node i (prefill nodes first) serves HTTP on --base-port + i and its side channel on --base-port + 1000 + i.
Flags after `--` go to every `hybridpd serve`. A child that fails during start-up makes `up` exit at once (non-zero,
with the child's name and log tail); one that dies later is restarted with backoff (`--restart on-failure`, the
default; `--restart never` exits instead), each restart logged with its exit cause. The proxy routes around a node
while it is down (retries on another prefill node, or the decode node prefills). Every child is stopped in every
case.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from hybridpd.launcher.cluster import LocalCluster
from hybridpd.launcher.errors import ClusterError, StartupInterruptedError
from hybridpd.launcher.spec import ClusterSpec
from hybridpd.launcher.supervisor import RestartPolicy, Supervisor

_WATCH_SECONDS = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=int, default=1, help="number of prefill nodes")
    parser.add_argument("--decode", type=int, default=1, help="number of decode nodes")
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the built-in model)")
    parser.add_argument("--host", default="127.0.0.1", help="address every process listens on")
    parser.add_argument("--port", type=int, default=8000, help="the proxy's port")
    parser.add_argument("--base-port", type=int, default=8100, help="node i: HTTP base+i, side channel base+1000+i")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument("--run-dir", type=Path, default=None, help="where the logs go (default: a new temp dir)")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds until all must be healthy")
    parser.add_argument("--stop-grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--routing", default=None, help="the proxy's --routing")
    parser.add_argument("--proxy-arg", dest="proxy_args", action="append", default=[], metavar="FLAG",
                        help="one more `hybridpd proxy` flag (repeat it; a flag with a value as "
                             "--proxy-arg=--prefill-timeout=30)")
    parser.add_argument("--restart", choices=[p.value for p in RestartPolicy], default=RestartPolicy.ON_FAILURE.value,
                        help="restart a node or the proxy that dies after start-up (with backoff), or exit")
    parser.add_argument("serve_args", nargs="*", metavar="-- SERVE_FLAGS",
                        help="extra `hybridpd serve` flags for every node, after `--`")


def spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    """Raises ValueError with a message meant for the user."""
    return ClusterSpec(
        num_prefill=args.prefill, num_decode=args.decode, model_dir=args.model, host=args.host, port=args.port,
        base_port=args.base_port, threads=args.threads, serve_args=tuple(args.serve_args),
        proxy_args=(*(("--routing", args.routing) if args.routing else ()), *args.proxy_args), run_dir=args.run_dir,
        startup_timeout=args.startup_timeout, stop_grace=args.stop_grace,
        kv_events=args.routing == "cache_aware",
    )


def run(args: argparse.Namespace) -> int:
    try:
        spec = spec_from_args(args)
    except ValueError as exc:
        print(f"hybridpd up: error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    cluster = LocalCluster(spec, stop_requested=stop)
    try:
        print(f"hybridpd up: starting {spec.num_prefill} prefill + {spec.num_decode} decode nodes ...", flush=True)
        info = cluster.start()
        print(info.describe(), "\nPress Ctrl-C to stop.", sep="", flush=True)
        supervisor = Supervisor(list(cluster.children), RestartPolicy(args.restart), cluster.respawn,
                                report=lambda line: print(line, flush=True))
        while not stop.wait(_WATCH_SECONDS):
            supervisor.check()
        print("hybridpd up: stopping ...", flush=True)
        return 0
    except StartupInterruptedError:
        print("hybridpd up: interrupted while starting; stopped every process", file=sys.stderr)
        return 130
    except ClusterError as exc:
        print(f"hybridpd up: error: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridpd up", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
