"""A kv_both node: an HTTP front and an engine process (`hybridpd.server.engine_process`: the engine, its connector,
its KV event publisher), joined by an engine link (`hybridpd.server.engine_link`).

The front holds the OpenAI-compatible app, the tokenizer and the cluster-token checks, and starts the engine process
with the node's configs; once the engine process has its engine, transport and side channel up, the front serves
HTTP and prints the ready line. `/metrics` serves the front's own families and the engine process's.

Stop order on SIGTERM/SIGINT: stop admitting HTTP requests (503); within one `--shutdown-grace`, let running
requests finish; then `Drain` the engine process with what is left of the grace (decoders pulling from us release
their leases; the leases left are released, the requests left aborted, the side channel and transport closed);
close HTTP; wait for the engine process; exit 0 (1 when the engine process had died or did not drain).
An engine process that dies on its own (killed, its engine thread crashed) ends the node too, with exit code 1, so
that a supervisor (`hybridpd up`, Kubernetes) restarts the whole node rather than leave a front that can only 503.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from aiohttp import web
from prometheus_client import CollectorRegistry

from hybridpd.access_log import runner_kwargs
from hybridpd.engine.tokenizer import load_tokenizer
from hybridpd.errors import EngineDeadError
from hybridpd.gc_heap import freeze_startup_heap
from hybridpd.server.app import ADMISSION_KEY, create_app, probe_app
from hybridpd.server.args import NodeConfigs
from hybridpd.server.engine_link import StartFailed
from hybridpd.server.kv_events_routes import kv_events_routes
from hybridpd.server.lease_routes import lease_routes
from hybridpd.server.remote_engine import EngineProcess, RemoteEngine
from hybridpd.tracing import Tracer, start_tracing

log = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    """The engine process could not start for a reason other than its configuration (the CLI exits 1)."""


def keep_off(cpus: frozenset[int] | None) -> None:
    """With `--engine-cpus`, the front runs on the other cores (when there are any)."""
    if cpus is None:
        return
    others = frozenset(os.sched_getaffinity(0)) - cpus
    if others:
        os.sched_setaffinity(0, others)


# After the engine died, how long the node waits for its connections to close before it exits regardless (a
# supervisor restarts it; a node that lingered for aiohttp's 60-s shutdown timeout would be a node down for a minute).
ENGINE_DEAD_CLEANUP_S = 5.0


async def _cleanup(runners: list[web.AppRunner], tracer: Tracer) -> None:
    for runner in runners:
        await runner.cleanup()
    await asyncio.to_thread(tracer.shutdown)   # the spans still batched go out


async def _first_of(*events: asyncio.Event) -> None:
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


class Node:
    def __init__(self, configs: NodeConfigs) -> None:
        self.configs = configs
        self.stopping = asyncio.Event()

    async def run(self) -> int:
        process = EngineProcess.spawn(self.configs)
        try:
            return await self._serve(process)
        finally:
            await process.stop()

    async def _serve(self, process: EngineProcess) -> int:
        cfg = self.configs
        started = await process.started()
        if isinstance(started, StartFailed):
            if started.bad_configuration:
                raise ValueError(started.message)
            raise EngineStartError(started.message)
        info = started.info
        keep_off(cfg.engine.cpus)
        tokenizer = await asyncio.to_thread(load_tokenizer, cfg.engine.model_dir, info.vocab_size,
                                            skip_init=cfg.engine.skip_tokenizer_init,
                                            chat_template=cfg.server.chat_template)
        engine = RemoteEngine(process.link, info, cfg.server.served_model_name, tokenizer, cfg.server.watchdog)
        engine.start()

        events_routes = kv_events_routes(
            cfg.kv_events, info.groups, host=cfg.kv_transfer.kv_host, instance_id=info.engine_id,
            reset_prefix_cache=engine.reset_prefix_cache, cluster_token=cfg.server.cluster_token)
        routes = [*events_routes, *lease_routes(engine.release_lease, cfg.server.cluster_token)]
        tracer = start_tracing("hybridpd-node", cfg.server.otlp_traces_endpoint)
        app = create_app(engine, cfg.server, CollectorRegistry(), extra_routes=routes,
                         engine_metrics=engine.metrics_text, tracer=tracer)
        runner = web.AppRunner(app, handler_cancellation=True,
                               **runner_kwargs(cfg.server.access_log, cfg.server.access_log_excluded))
        await runner.setup()
        tls = cfg.server.tls
        site = web.TCPSite(runner, cfg.server.host, cfg.server.port,
                           ssl_context=tls.server_context() if tls is not None else None)
        await site.start()
        probes = None
        if cfg.server.health_port is not None:
            probes = web.AppRunner(probe_app(app), access_log=None)
            await probes.setup()
            await web.TCPSite(probes, cfg.server.host, cfg.server.health_port).start()
        runners = [runner] if probes is None else [probes, runner]
        freeze_startup_heap()   # the tokenizer, the app, the modules: as long-lived as the process
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        scheme = cfg.server.scheme
        log.info("node %s serving %s on %s://%s:%d (side channel %s:%d, engine process %d)", info.engine_id,
                 cfg.server.served_model_name, scheme, cfg.server.host, cfg.server.port, cfg.kv_transfer.kv_host,
                 info.side_channel_port, process.process.pid)
        print(f"hybridpd node ready: {scheme}://{cfg.server.host}:{cfg.server.port} side-channel "
              f"{cfg.kv_transfer.kv_host}:{info.side_channel_port} engine {info.engine_id}", flush=True)

        await _first_of(self.stopping, engine.dead)
        if engine.dead.is_set():
            log.error("the engine process died: the node exits so that its supervisor restarts it")
            app[ADMISSION_KEY].close()
            try:   # aiohttp would wait up to 60 s for handlers still open; none of them can finish now
                await asyncio.wait_for(_cleanup(runners, tracer), ENGINE_DEAD_CLEANUP_S)
            except asyncio.TimeoutError:
                log.error("connections still open %.0f s after the engine died: closed with the process",
                          ENGINE_DEAD_CLEANUP_S)
            return 1
        grace = cfg.server.shutdown_grace
        log.info("shutting down (grace %.1f s)", grace)
        admission = app[ADMISSION_KEY]
        admission.close()
        deadline = loop.time() + grace
        await admission.wait_idle(grace)
        aborted = engine.num_active_requests
        try:
            released = await engine.drain(max(0.0, deadline - loop.time()))
        except (EngineDeadError, asyncio.TimeoutError) as exc:
            log.error("the engine process did not drain: %s", exc)
            await _cleanup(runners, tracer)
            return 1
        log.info("drained: %d request(s) aborted, %d lease(s) released at shutdown", aborted, released)
        await _cleanup(runners, tracer)
        return 0
