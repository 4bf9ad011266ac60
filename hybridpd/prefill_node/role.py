"""The producer role of a kv_both node.

A request with `kv_transfer_params.do_remote_decode` goes WAITING -> PREFILLING (the whole prompt, then one sampled
token, as a colocated request computes it) -> HELD(lease) -> RELEASED (the decoder said so) or EXPIRED (nobody
renewed the lease in time). On HELD the node answers with its first token and the top-level `kv_transfer_params`
that tell the decoder where the blocks are and which token to decode on from; on RELEASED or EXPIRED the blocks go
back to the pool and stay in the prefix cache.
"""

from __future__ import annotations

import asyncio
import logging
import time

from hybridpd.connector.lease_view import prompt_digest
from hybridpd.connector.metrics import ConnectorMetrics
from hybridpd.engine.transfer_params import RemotePrefillParams
from hybridpd.connector.transport import Transport
from hybridpd.engine.async_engine import AsyncEngine
from hybridpd.engine.request import TokenLogprob
from hybridpd.engine.sequence import Sequence
from hybridpd.prefill_node.leases import Lease, LeaseTable
from hybridpd.tracing import NoTracer, Tracer

log = logging.getLogger(__name__)

PROGRESS_POLL_S = 0.001
IDLE_POLL_S = 0.05


class PrefillRole:
    def __init__(self, engine: AsyncEngine, transport: Transport, *, engine_id: str, advertised_host: str,
                 side_channel_port: int, lease_seconds: float, metrics: ConnectorMetrics,
                 tracer: Tracer | None = None) -> None:
        self.engine = engine
        self.transport = transport
        self.metrics = metrics
        self.tracer = tracer or NoTracer()
        self.engine_id = engine_id
        self.advertised_host = advertised_host
        self.side_channel_port = side_channel_port
        self.leases = LeaseTable(lease_seconds, clock=time.monotonic)
        self._sweeper: asyncio.Task | None = None
        self._progress: asyncio.Task | None = None
        # Requests whose decoder has started reading (its heartbeat, sent beside the READ, arrived); those whose
        # lease has ended (released, expired) are dropped at the progress loop's next check (`_reads_in_flight`).
        self._reading: set[str] = set()
        # Set when a read starts: wakes the transport progress loop at once, instead of after an idle poll (which
        # cost a pull up to 50 ms before the READ could complete).
        self._read_started: asyncio.Event | None = None

    # -- engine thread ------------------------------------------------------------------------------------------
    def hold(self, seq: Sequence, first_token_logprob: TokenLogprob | None) -> dict:
        """The engine computed `seq`'s prompt and sampled its first token: lease exactly the blocks a decoder needs
        and say where, and which token it decodes on from."""
        core = self.engine.engine
        num_tokens = seq.num_prompt_tokens
        table = core.kv.block_table(seq.request_id)
        block_ids = tuple(
            tuple(table[g][slice(*group.spec.needed_span(num_tokens))]) for g, group in enumerate(core.groups)
        )
        granted = time.monotonic()
        lease = self.leases.add(seq.request_id, block_ids, num_tokens, prompt_digest(seq.prompt_token_ids))
        self.metrics.lease_acquired()
        self.tracer.record("lease grant", dict(seq.trace_context), granted, time.monotonic(), {
            "gen_ai.request.id": seq.request_id, "hybridpd.lease.tokens": num_tokens,
            "hybridpd.lease.blocks": sum(map(len, block_ids)), "hybridpd.lease.seconds": self.leases.lease_seconds})
        return RemotePrefillParams(
            remote_engine_id=self.engine_id,
            remote_request_id=seq.request_id,
            remote_block_ids=block_ids,
            remote_host=self.advertised_host,
            remote_port=self.side_channel_port,
            remote_num_tokens=num_tokens,
            remote_cached_tokens=seq.num_cached_tokens,
            remote_lease_expiry=self.leases.unix_time(lease.expiry),
            remote_lease_secret=lease.secret,
            first_token_id=seq.output_token_ids[0],
            first_token_logprob=first_token_logprob,
        ).to_json()

    # -- side channel (event loop) ------------------------------------------------------------------------------
    def heartbeat(self, request_id: str, secret: str) -> Lease:
        """Renew; raises LookupError with the reason when the lease is not live or not the asker's. A decoder sends
        its first heartbeat beside its READ: from then on the transport is progressed for it."""
        lease = self.leases.renew(request_id, secret)
        self._reading.add(request_id)
        if self._read_started is not None:
            self._read_started.set()
        return lease

    def release(self, request_id: str, aborted: bool, secret: str) -> bool:
        lease = self.leases.release(request_id, secret)
        if lease is None:
            return False
        self._free(lease)
        self.metrics.lease_released()
        log.debug("lease %s released (%s)", request_id, "aborted" if aborted else "done")
        return True

    def _free(self, lease: Lease) -> None:
        self.engine.call_soon(lambda: self.engine.engine.kv.free(lease.request_id))

    # -- expiry and transport progress ---------------------------------------------------------------------
    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._read_started = asyncio.Event()
        self._sweeper = loop.create_task(self._sweep())
        self._progress = loop.create_task(self._make_progress())

    async def wait_released(self, timeout: float) -> bool:
        """True once no lease is held (decoders released them, or they expired) within `timeout` seconds.
        Graceful shutdown waits here, with the side channel and transport progress still running, so that
        decoders already pulling from this node finish."""
        deadline = asyncio.get_running_loop().time() + timeout
        while len(self.leases):
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(IDLE_POLL_S)
        return True

    async def stop(self) -> int:
        """Stop the sweeper and progress tasks and end every lease still held (their blocks are freed on the
        engine thread, so call this before the engine stops); returns how many leases it ended."""
        for task in (self._sweeper, self._progress):
            if task is not None:
                task.cancel()
        leases = self.leases.drain()
        for lease in leases:
            self._free(lease)
            self.metrics.lease_released()
        return len(leases)

    async def _sweep(self) -> None:
        period = min(1.0, self.leases.lease_seconds / 4)
        while True:
            await asyncio.sleep(period)
            for lease in self.leases.expire_due():
                log.warning("lease on request %s expired before the decoder released it", lease.request_id)
                self._free(lease)
                self.metrics.lease_expired()

    async def _make_progress(self) -> None:
        """On one host, a decoder's READ of our blocks completes only while we poll our transport (measured:
        UCX's control messages travel over loopback TCP), so poll every millisecond while a read may be in flight:
        from a lease's first heartbeat (a decoder sends it beside its READ) until the lease ends. A lease whose
        decoder has not started reading needs no polling: in P/D most leases wait for their decode call, and a
        1 kHz poll beside the engine thread cost it ~2% of its step time and the process ~4% of a core."""
        read_started = self._read_started
        if read_started is None:
            raise RuntimeError("start() creates the read event before the progress loop runs")
        while True:
            if self._reads_in_flight():
                self.transport.get_notifs()
                await asyncio.sleep(PROGRESS_POLL_S)
                continue
            read_started.clear()
            if not self._reads_in_flight():  # checked after the clear: a read started since then sets it again
                await read_started.wait()

    def _reads_in_flight(self) -> bool:
        """Whether a lease a decoder reads is still held (one whose lease ended otherwise is dropped here)."""
        self._reading = {request_id for request_id in self._reading if request_id in self.leases}
        return bool(self._reading)
