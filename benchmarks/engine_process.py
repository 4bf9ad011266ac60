"""The engine in a process of its own, measured: `hybridpd serve` against the same HTTP app whose engine runs in a
separate process behind a pipe, side by side on one checkpoint, driven by one client (`hybridpd bench`).

Why: inside `hybridpd serve` the engine thread shares the GIL with the event loop, which does every request's
per-token work (asyncio wake-ups, chunks, socket writes). Timing the engine thread inside the node, a step takes
8-10% longer than the thread's own CPU time, and that CPU time is ~8-12% above the same step in-process without
HTTP (benchmarks/README.md). vLLM runs its API server and its engine core in separate processes; this harness
measures what that would buy us before the node is rebuilt that way.

The split side is a measurement harness, not a product path: it serves colocated requests only (no connector, no
KV events, no engine metrics), and its front reads the tokenizer and limits from the checkpoint itself. The engine
process runs `LLMEngine` with the node's defaults and pins itself to `--engine-cpus`, as `hybridpd serve
--engine-cpus` pins its engine thread; the front runs `hybridpd.server.app.create_app` unchanged.

Both servers run at once; each workload runs `--rounds` times alternating the sides (serve, split, split, serve,
...). Last line: JSON {"workloads": {name: {throughput_ratio, mean_ttft_ratio, p99_itl_ratio, split, serve}}}, the
ratios split / serve (each side pooled as the mean of its rounds).

    .venv/bin/python benchmarks/engine_process.py --rounds 3 --workloads random_256_64_c16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_vllm import VLLM_PRESET, WORKLOADS, run_bench, side_by_side, stop_all, wait_ready  # noqa: E402

from hybridpd.engine.cpu_set import parse_cpu_list  # noqa: E402
from hybridpd.engine.request import EngineRequest, RequestOutput  # noqa: E402
from hybridpd.errors import EngineDeadError  # noqa: E402
from hybridpd.launcher.ports import free_port  # noqa: E402

READY_DEADLINE = 300.0
ENGINE_CPUS = "0"  # both sides' engines run here (`--engine-cpus`), as vs_vllm.py pins both sides' compute


def _configs(serve_argv: list[str]) -> Any:
    """The node's configs from `hybridpd serve`'s own arguments (NodeConfigs)."""
    from hybridpd.engine.model.presets import default_model_dir
    from hybridpd.server.args import add_arguments, configs_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return configs_from_args(parser.parse_args(serve_argv), default_model_dir)


# -- the engine process -------------------------------------------------------------------------------------------
def engine_main(conn: Connection, serve_argv: list[str], cpus: frozenset[int]) -> None:
    """Runs `LLMEngine` built from `hybridpd serve`'s own arguments: requests ("add", EngineRequest) and
    ("abort", id) come in on `conn`, each step's outputs go out as one list; a rejected request gets
    ("rejected", id, error)."""
    from hybridpd.engine.engine import LLMEngine

    os.sched_setaffinity(0, cpus)
    engine = LLMEngine(_configs(serve_argv).engine)
    conn.send("ready")
    try:
        _serve_engine(conn, engine)
    except EOFError:  # the front is gone
        pass


def _serve_engine(conn: Connection, engine: Any) -> None:
    while True:
        if not engine.has_work():
            conn.poll(None)
        while conn.poll(0):
            message = conn.recv()
            if message[0] == "add":
                request: EngineRequest = message[1]
                try:
                    first = engine.add_request(request)  # validates first
                except Exception as exc:  # noqa: BLE001 - the front raises it for the request
                    conn.send(("rejected", request.request_id, exc))
                    continue
                if first is not None:
                    conn.send([first])
            elif message[0] == "abort":
                engine.abort(message[1])
            else:
                return
        if engine.has_work():
            outputs = engine.step()
            if outputs:
                conn.send(outputs)


# -- the front: an EngineClient over the pipe ----------------------------------------------------------------------
class PipeEngine:
    """What `create_app` needs of an engine, with the engine in another process."""

    def __init__(self, conn: Connection, model_dir: Path, model_name: str, max_model_len: int | None) -> None:
        from hybridpd.engine.model.generation_config import GenerationDefaults
        from hybridpd.engine.model.loader import read_model_config
        from hybridpd.engine.tokenizer import load_tokenizer

        config, _ = read_model_config(model_dir)
        self.model_name = model_name
        self.vocab_size = config.vocab_size
        self.max_model_len = max_model_len or config.max_position_embeddings
        self.tokenizer = load_tokenizer(model_dir, config.vocab_size)
        self.generation_defaults = GenerationDefaults.from_model_dir(model_dir)
        self._conn = conn
        self._send_lock = threading.Lock()
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._alive = True

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, name="engine-pipe", daemon=True).start()

    def healthy(self) -> bool:
        return self._alive

    def _read(self) -> None:
        assert self._loop is not None
        try:
            while True:
                self._loop.call_soon_threadsafe(self._deliver, self._conn.recv())
        except (EOFError, OSError):
            self._alive = False
            self._loop.call_soon_threadsafe(self._fail_all)

    def _fail_all(self) -> None:
        """The engine process is gone: every request in flight ends with an error instead of waiting forever."""
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError("the engine process exited"))

    def _deliver(self, message: Any) -> None:
        if isinstance(message, tuple):  # ("rejected", id, error)
            queue = self._queues.get(message[1])
            if queue is not None:
                queue.put_nowait(message[2])
            return
        for output in message:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request.request_id] = queue
        self._send(("add", request))
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request.request_id, None)
            if not finished:
                self._send(("abort", request.request_id))


async def serve_split(serve_argv: list[str], cpus: frozenset[int]) -> None:
    """The front process: `create_app` over a PipeEngine, on the port `serve_argv` names."""
    from aiohttp import web
    from prometheus_client import CollectorRegistry

    from hybridpd.server.app import create_app

    configs = _configs(serve_argv)
    context = multiprocessing.get_context("spawn")
    front_end, engine_end = context.Pipe()
    engine = context.Process(target=engine_main, args=(engine_end, serve_argv, cpus), daemon=True)
    engine.start()
    if front_end.recv() != "ready":
        raise RuntimeError("the engine process did not start")
    others = frozenset(os.sched_getaffinity(0)) - cpus
    if others:
        os.sched_setaffinity(0, others)
    client = PipeEngine(front_end, configs.engine.model_dir, configs.server.served_model_name,
                        configs.engine.scheduler.max_model_len)
    client.start()
    runner = web.AppRunner(create_app(client, configs.server, CollectorRegistry()), handler_cancellation=True,
                           access_log=None)
    await runner.setup()
    await web.TCPSite(runner, configs.server.host, configs.server.port).start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        front_end.send(("stop",))
        engine.join(5)


# -- the driver ---------------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help=f"checkpoint dir (default: the {VLLM_PRESET} preset)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["random_256_64_c16"], choices=list(WORKLOADS))
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--serve-split", nargs=argparse.REMAINDER, default=None,
                        help=argparse.SUPPRESS)  # internal: run the split side's front with these serve arguments
    args = parser.parse_args()
    cpus = parse_cpu_list(ENGINE_CPUS)
    if args.serve_split is not None:
        asyncio.run(serve_split(args.serve_split, cpus))
        return 0
    if args.model is None:
        from hybridpd.engine.model.presets import default_model_dir
        args.model = default_model_dir(VLLM_PRESET)
    ports = {"serve": free_port("127.0.0.1"), "split": free_port("127.0.0.1")}
    common = [str(args.model), "--host", "127.0.0.1", "--threads", "1", "--kv-cache-memory",
              f"{args.kv_cache_gib}GiB", "--no-enable-prefix-caching"]
    commands = {
        "serve": [sys.executable, "-m", "hybridpd", "serve", *common, "--port", str(ports["serve"]),
                  "--engine-cpus", ENGINE_CPUS],
        "split": [sys.executable, __file__, "--serve-split", *common, "--port", str(ports["split"])],
    }
    urls = {side: f"http://127.0.0.1:{port}" for side, port in ports.items()}
    processes = {side: subprocess.Popen(command) for side, command in commands.items()}
    try:
        for side, url in urls.items():
            wait_ready(url, processes[side], READY_DEADLINE)
        for name in args.workloads:  # warm-up, not counted
            for url in urls.values():
                run_bench(url, WORKLOADS[name], seed=99)
        results = side_by_side({"split": urls["split"], "serve": urls["serve"]}, args.workloads, args.rounds)
    finally:
        stop_all(processes.values())
    print(json.dumps({"rounds": args.rounds, "workloads": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
