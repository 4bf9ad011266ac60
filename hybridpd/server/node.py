"""A kv_both node: the engine, its connector (transport + side channel, both roles) and the HTTP server.

Start order: engine (model + KV cache) -> transport registers the group tensors -> side channel (gRPC) ->
HTTP. Stop order on SIGTERM/SIGINT: stop admitting HTTP requests (503); within one `--shutdown-grace`, let running
requests finish and decoders pulling from us release their leases (the side channel and transport stay up); then
release the leases left (freeing their blocks), abort the requests left, stop the side channel, close the
transport, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge

from hybridpd.connector.compat import compat_fields, compat_hash, model_identity
from hybridpd.connector.metadata import node_metadata
from hybridpd.connector.metrics import ConnectorMetrics
from hybridpd.connector.nixl_transport import NixlTransport
from hybridpd.connector.side_channel_server import SideChannelServer
from hybridpd.decode_node.loader import DecodeRole
from hybridpd.engine.async_engine import AsyncEngine
from hybridpd.engine.engine import LLMEngine
from hybridpd.engine.metrics import EngineCollector
from hybridpd.kv_events.publisher import ZmqEventPublisher
from hybridpd.kv_events.wire import GroupInfo
from hybridpd.prefill_node.role import PrefillRole
from hybridpd.prefill_node.side_channel import PrefillSideChannel
from hybridpd.server.app import ADMISSION_KEY, create_app
from hybridpd.server.args import NodeConfigs
from hybridpd.server.kv_events_routes import kv_events_routes

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class NodeAddresses:
    http_port: int
    kv_port: int


class Node:
    def __init__(self, configs: NodeConfigs) -> None:
        self.configs = configs
        self.engine_id = f"hybridpd-{uuid.uuid4().hex[:12]}"
        self.registry = CollectorRegistry()
        self.stopping = asyncio.Event()

    async def run(self) -> int:
        cfg = self.configs
        core = await asyncio.to_thread(LLMEngine, cfg.engine)
        EngineCollector(core).register(self.registry)
        groups = [GroupInfo.of(i, g) for i, g in enumerate(core.groups)]
        publisher = ZmqEventPublisher(cfg.kv_events, groups) if cfg.kv_events.publishes else None
        engine = AsyncEngine(core, cfg.server.served_model_name,
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
        metrics = ConnectorMetrics(self.registry)
        prefill = PrefillRole(engine, transport, engine_id=self.engine_id, advertised_host=cfg.kv_transfer.kv_host,
                              side_channel_port=cfg.kv_transfer.kv_port, lease_seconds=cfg.kv_transfer.lease_seconds,
                              metrics=metrics)
        decode = DecodeRole(engine, transport, engine_id=self.engine_id, compat_hash=hash_, compat_fields=fields,
                            config=cfg.kv_transfer, metrics=metrics)
        core.set_remote(decode, prefill.hold, cfg.kv_transfer.decode_skip_mamba_align)
        metadata = node_metadata(engine_id=self.engine_id, model_name=cfg.server.served_model_name,
                                 fields=fields, compat_hash=hash_, transport=transport, groups=core.groups,
                                 transport_address=cfg.kv_transfer.kv_host)
        tls = cfg.server.tls
        side = SideChannelServer(PrefillSideChannel(prefill, metadata), cfg.kv_transfer.kv_host,
                                 cfg.kv_transfer.kv_port, cfg.kv_transfer.cluster_token, cfg.server.trusted_peers,
                                 credentials=tls.grpc_server_credentials() if tls is not None else None)
        await side.start()
        prefill.side_channel_port = side.port
        prefill.start()

        events_routes = kv_events_routes(
            cfg.kv_events, groups, host=cfg.kv_transfer.kv_host, instance_id=self.engine_id,
            reset_prefix_cache=lambda: engine.call_soon(core.kv.reset_prefix_cache),
            cluster_token=cfg.server.cluster_token)
        app = create_app(engine, cfg.server, self.registry, extra_routes=events_routes)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, cfg.server.host, cfg.server.port,
                           ssl_context=tls.server_context() if tls is not None else None)
        await site.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        scheme = cfg.server.scheme
        log.info("node %s serving %s on %s://%s:%d (side channel %s:%d)", self.engine_id,
                 cfg.server.served_model_name, scheme, cfg.server.host, cfg.server.port, cfg.kv_transfer.kv_host,
                 side.port)
        print(f"hybridpd node ready: {scheme}://{cfg.server.host}:{cfg.server.port} side-channel "
              f"{cfg.kv_transfer.kv_host}:{side.port} engine {self.engine_id}", flush=True)

        await self.stopping.wait()
        grace = cfg.server.shutdown_grace
        log.info("shutting down (grace %.1f s)", grace)
        admission = app[ADMISSION_KEY]
        admission.close()
        deadline = loop.time() + grace
        await admission.wait_idle(grace)
        await prefill.wait_released(max(0.0, deadline - loop.time()))
        aborted = engine.num_active_requests
        released = await prefill.stop()  # frees on the engine thread: before the engine stops
        log.info("drained: %d request(s) aborted, %d lease(s) released at shutdown", aborted, released)
        await engine.shutdown(0.0)
        await decode.close()
        await side.stop(1.0)
        await runner.cleanup()
        transport.close()
        if publisher is not None:
            await asyncio.to_thread(publisher.close)
        return 0
