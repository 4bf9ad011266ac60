"""The node's engine process: the engine, its connector (transport, side channel, both roles) and its KV event
publisher, driven by the node's HTTP front over an engine link (`hybridpd.server.engine_link`).

    python -m hybridpd.server.engine_process FD PARENT_PID      (started by hybridpd.server.node, never by hand)

Why a process of its own: the HTTP front's per-token work (asyncio wake-ups, SSE chunks, socket writes) held the GIL
the engine thread needs between its torch calls; here the engine thread shares the GIL only with the side channel
and the link's reader, and sends each step's outputs to the front as one message (benchmarks/README.md).

Start order: engine (model + KV cache) -> transport registers the group tensors -> side channel (gRPC) ->
`EngineStarted` to the front. Stop order on `Drain(grace)` (or the front's end of the link closing): let decoders
pulling from us release their leases within the grace; release the leases left (freeing their blocks), abort the
requests left, stop the side channel, close the transport and the publisher, answer `Drained`, exit 0.

The GIL changes hands every 0.5 ms here instead of CPython's 5 ms (`GIL_SWITCH_INTERVAL_S`): while the engine thread
runs Python between its torch calls, the side channel's answers (a decode node's lease heartbeat waits for a busy
prefill node's), a pull's start and its end wait for the GIL: on `pd_vs_colocated.py`'s load the pull's start took
7.1 ms and the heartbeat's round trip 11.6 ms on average at 5 ms, 5.1 and 5.9 ms at 0.5 ms (benchmarks/README.md).

The process dies with its front (PR_SET_PDEATHSIG), and ignores SIGINT / SIGTERM: a Ctrl-C or a signal to the
process group reaches the front, which drains both.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
import threading
import uuid
from multiprocessing.connection import Connection

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from hybridpd.connector.compat import compat_fields, compat_hash, model_identity
from hybridpd.connector.metadata import node_metadata
from hybridpd.connector.metrics import ConnectorMetrics
from hybridpd.connector.nixl_transport import NixlTransport
from hybridpd.connector.side_channel_server import SideChannelServer
from hybridpd.decode_node.role import DecodeRole
from hybridpd.engine.async_engine import AsyncEngine
from hybridpd.engine.engine import LLMEngine
from hybridpd.engine.host_memory import allocator_configured, keep_freed_memory
from hybridpd.engine.metrics import EngineCollector
from hybridpd.engine.request import RequestOutput
from hybridpd.gc_heap import freeze_startup_heap
from hybridpd.kv_events.groups import GroupInfo
from hybridpd.kv_events.publisher import ZmqEventPublisher
from hybridpd.named_thread import NamedThread, name_native_thread
from hybridpd.prefill_node.role import PrefillRole
from hybridpd.prefill_node.side_channel import PrefillSideChannel
from hybridpd.server.args import NodeConfigs
from hybridpd.server.config import LOOPBACK
from hybridpd.server.watchdog import BEAT_INTERVAL_S
from hybridpd.tracing import start_tracing
from hybridpd.server.engine_link import (
    Abort,
    Aborted,
    Drain,
    Drained,
    EngineFailed,
    EngineInfo,
    EngineStarted,
    Heartbeat,
    LinkEnd,
    MetricsText,
    Outputs,
    Rejected,
    ReleaseLease,
    ResetPrefixCache,
    ScrapeMetrics,
    StartFailed,
    Submit,
    portable_error,
    portable_outputs,
)

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
GIL_SWITCH_INTERVAL_S = 0.0005   # see the module docstring


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent exits, however it exits (the fault matrix SIGKILLs nodes)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent was gone before the prctl
        os._exit(1)


class PipeSink:
    """The engine thread's outputs to the front: one `Outputs` message per step. A front that is gone is not the
    engine's failure: the reader sees the link close and drains."""

    def __init__(self, link: LinkEnd) -> None:
        self._link = link

    def _send(self, message: object) -> None:
        try:
            self._link.send(message)
        except OSError:
            pass

    def deliver(self, outputs: list[RequestOutput]) -> None:
        self._send(Outputs(portable_outputs(outputs)))

    def rejected(self, request_id: str, error: Exception) -> None:
        self._send(Rejected(request_id, portable_error(error)))

    def aborted(self, request_id: str) -> None:
        self._send(Aborted(request_id))

    def died(self, error: BaseException) -> None:
        self._send(EngineFailed(f"{type(error).__name__}: {error}"))


class EngineSide:
    def __init__(self, configs: NodeConfigs, link: LinkEnd) -> None:
        self.configs = configs
        self.link = link
        self.engine_id = f"hybridpd-{uuid.uuid4().hex[:12]}"
        self.registry = CollectorRegistry()

    async def run(self) -> int:
        try:
            await self._start()
        except (ValueError, FileNotFoundError) as exc:  # a checkpoint or cache configuration that cannot work
            self.link.send(StartFailed(str(exc), bad_configuration=True))
            return 2
        except Exception as exc:  # noqa: BLE001 - the front reports it and exits
            log.exception("the engine process could not start")
            self.link.send(StartFailed(f"{type(exc).__name__}: {exc}", bad_configuration=False))
            return 1
        freeze_startup_heap()   # the model, the cache's block objects, the modules: as long-lived as the process
        self.link.send(EngineStarted(self.info))
        self._loop = asyncio.get_running_loop()
        self._drain: asyncio.Future[float] = self._loop.create_future()
        NamedThread(target=self._read, name="engine-link", daemon=True).start()
        stopped = threading.Event()
        NamedThread(target=self._beat, args=(stopped,), name="engine-beat", daemon=True).start()
        grace = await self._drain
        released = await self._stop(grace)
        stopped.set()
        try:
            self.link.send(Drained(released))
        except OSError:
            pass
        return 0

    async def _start(self) -> None:
        cfg = self.configs
        self.tracer = start_tracing("hybridpd-node-engine", cfg.server.otlp_traces_endpoint)
        core = await asyncio.to_thread(LLMEngine, cfg.engine)
        EngineCollector(core, cfg.server.served_model_name).register(self.registry)
        groups = tuple(GroupInfo.of(i, g) for i, g in enumerate(core.groups))
        publisher = (ZmqEventPublisher(cfg.kv_events, groups, cfg.server.host) if cfg.kv_events.publishes
                     else None)
        engine = AsyncEngine(core, cfg.server.served_model_name, sink=PipeSink(self.link),
                             kv_event_sink=publisher.publish if publisher is not None else None)
        if publisher is not None:
            Gauge("hybridpd:kv_event_batches_published", "KV event batches sent on the PUB socket",
                  registry=self.registry).set_function(lambda: publisher.published)
            Gauge("hybridpd:kv_event_batches_dropped", "KV event batches dropped because the publisher queue was full",
                  registry=self.registry).set_function(lambda: publisher.dropped)
        engine.start()

        transport = NixlTransport(self.engine_id, progress_thread=cfg.kv_transfer.kv_host not in LOOPBACK)
        transport.register(core.storage.tensors)
        fields = compat_fields(model=model_identity(cfg.engine.model_dir), dtype=cfg.engine.dtype, groups=core.groups)
        hash_ = compat_hash(fields)
        metrics = ConnectorMetrics(self.registry, cfg.server.served_model_name)
        prefill = PrefillRole(engine, transport, engine_id=self.engine_id, advertised_host=cfg.kv_transfer.kv_host,
                              side_channel_port=cfg.kv_transfer.kv_port, lease_seconds=cfg.kv_transfer.lease_seconds,
                              metrics=metrics, tracer=self.tracer)
        decode = DecodeRole(engine, transport, engine_id=self.engine_id, compat_hash=hash_, compat_fields=fields,
                            config=cfg.kv_transfer, metrics=metrics, tracer=self.tracer)
        core.set_remote(decode, prefill.hold, cfg.kv_transfer.decode_skip_mamba_align)
        metadata = node_metadata(engine_id=self.engine_id, model_name=cfg.server.served_model_name,
                                 fields=fields, compat_hash=hash_, transport=transport, groups=core.groups,
                                 transport_address=cfg.kv_transfer.kv_host)
        tls = cfg.server.tls
        side = SideChannelServer(PrefillSideChannel(prefill, metadata, self.tracer), cfg.kv_transfer.kv_host,
                                 cfg.kv_transfer.kv_port, cfg.kv_transfer.cluster_token, cfg.server.trusted_peers,
                                 credentials=tls.grpc_server_credentials() if tls is not None else None)
        await side.start()
        prefill.side_channel_port = side.port
        prefill.start()
        self.core, self.engine, self.publisher = core, engine, publisher
        self.transport, self.prefill, self.decode, self.side = transport, prefill, decode, side
        self.info = EngineInfo(engine_id=self.engine_id, max_model_len=core.max_model_len,
                               vocab_size=core.model_config.vocab_size, generation_defaults=core.generation_defaults,
                               groups=groups, side_channel_port=side.port)

    async def _stop(self, grace: float) -> int:
        await self.prefill.wait_released(grace)
        released = await self.prefill.stop()  # frees on the engine thread: before the engine stops
        await self.engine.shutdown(0.0)        # the front has drained its requests: what is left is aborted
        await self.decode.close()
        await self.side.stop(1.0)
        self.transport.close()
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.close)
        await asyncio.to_thread(self.tracer.shutdown)
        log.info("engine stopped: %d lease(s) released at shutdown", released)
        return released

    # -- the link -------------------------------------------------------------------------------------------------
    def _beat(self, stopped: threading.Event) -> None:
        """The front's watchdog hears from us every second while we live (server/watchdog.py)."""
        while not stopped.wait(BEAT_INTERVAL_S):
            try:
                self.link.send(Heartbeat(self.engine.steps, self.engine.busy))
            except OSError:
                return

    def _read(self) -> None:
        """Requests go straight to the engine's inbox; everything else to the event loop."""
        try:
            while True:
                message = self.link.recv()
                if isinstance(message, Submit):
                    self.engine.submit(message.request)
                elif isinstance(message, Abort):
                    self.engine.abort(message.request_id)
                else:
                    self._post(message)
        except (EOFError, OSError):  # the front is gone: stop at once
            self._post(Drain(0.0))

    def _post(self, message: object) -> None:
        """To the event loop, unless it has already closed (the process is on its way out)."""
        try:
            self._loop.call_soon_threadsafe(self._control, message)
        except RuntimeError:
            pass

    def _control(self, message: object) -> None:
        if isinstance(message, ScrapeMetrics):
            self.link.send(MetricsText(message.nonce, generate_latest(self.registry)))
        elif isinstance(message, ResetPrefixCache):
            self.engine.call_soon(self.core.kv.reset_prefix_cache)
        elif isinstance(message, ReleaseLease):
            if self.prefill.release(message.request_id, aborted=True, secret=message.secret):
                log.info("lease on %s released: its decode side never took it", message.request_id)
        elif isinstance(message, Drain):
            if not self._drain.done():
                self._drain.set_result(message.grace)
        else:
            log.error("unexpected message on the engine link: %r", message)


def main(argv: list[str]) -> int:
    fd, parent_pid = int(argv[0]), int(argv[1])
    die_with_parent(parent_pid)
    name_native_thread("engine-process")   # what top and ps show for this process; its threads name themselves
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not allocator_configured(os.environ) and not keep_freed_memory():
        log.info("mallopt unavailable: the allocator keeps its default thresholds")
    link = LinkEnd(Connection(fd))
    configs = link.recv()
    if not isinstance(configs, NodeConfigs):
        raise SystemExit("the engine link did not start with the node's configs")
    return asyncio.run(EngineSide(configs, link).run())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
