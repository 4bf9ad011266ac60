"""The consumer role of a kv_both node: pull a remotely prefilled prompt's KV, then decode.

A request with `kv_transfer_params.do_remote_prefill` goes WAITING (local prefix hit with `skip_mamba_align`:
the full-attention groups decide) -> WAITING_FOR_REMOTE_KV (its blocks are allocated, windows only in-window; the
missing full-attention blocks, the window blocks it lacks and the Mamba state are READ from the prefill node while
other requests keep running) -> RUNNING (it decodes on from the first token the prefill node sampled, which it
streamed at admission) -> FINISHED | FAILED. A request that its first token already ends (EOS, a stop string,
`max_tokens: 1`) pulls nothing: its lease is released at once (`discard`).

The pull, step by step: the peer's metadata (compatibility hash and engine id checked, once per peer); one batch
of READs of the blocks `kv_transfer_params` names, with a heartbeat in flight at the same time that renews the lease
and says what it covers (tokens, prompt digest, blocks: any difference fails the pull, and the bytes are never
used); heartbeats while the READ runs; then `Release`. The bytes are trusted only if the lease was live for the
whole READ: the heartbeat proves it was live until its answer and for `seconds_left` after, measured from before
the READ started, so a READ that ended within that time is done and its Release goes out in the background; a
slower one (or a peer that does not say) waits for the Release's answer that the lease was still live. How the pull
ends (its verdict, and a READ that could not be cancelled) is one state machine per pull, `PullEnd`, the only thing
that tells the engine. A READ that could not be cancelled is waited for at most `DRAIN_LIMIT_S`; then its peer is
removed from the transport (which fails what it still has in flight) and the blocks go back unhashed.
A lease that does not match the request (another prompt, other blocks) is not ours: the pull fails without releasing
it, so the request that does hold it is not robbed of it. Side-channel clients and transport peers live in a bounded
LRU with idle expiry (decode_node/peers.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from hybridpd.config import KVLoadFailurePolicy, KVTransferConfig
from hybridpd.connector.compat import describe_mismatch
from hybridpd.connector.lease_view import LeaseView, prompt_digest
from hybridpd.connector.metrics import ConnectorMetrics
from hybridpd.engine.transfer_params import RemotePrefillParams
from hybridpd.connector.side_channel_client import SideChannelClient
from hybridpd.connector.transport import BlockRead, RegionLayout, TransferState, Transport
from hybridpd.decode_node.peers import Address, Peer, PeerCache
from hybridpd.decode_node.pull_end import PullEnd
from hybridpd.engine.async_engine import AsyncEngine
from hybridpd.engine.kv_cache.coordinator import StepBlocks
from hybridpd.engine.sequence import Sequence
from hybridpd.errors import KVTransferError
from hybridpd.tracing import NoTracer, Tracer

log = logging.getLogger(__name__)

_POLL_FIRST_S = 50e-6
_POLL_MAX_S = 2e-3
_LEASE_MARGIN_S = 0.25     # of a lease's proven lifetime, not relied on
_RELEASE_TIMEOUT_S = 2.0
_MIN_RENEW_S = 0.1         # renew at most every 50 ms, whatever a peer says is left
DRAIN_LIMIT_S = 30.0       # how long a READ we gave up on may take to stop before its peer is removed
_SWEEP_S = 30.0            # how often idle peers are closed


class LeaseMismatchError(KVTransferError):
    """The lease the heartbeat renewed is not the one the request claims: it belongs to another request."""


@dataclass(frozen=True, kw_only=True)
class PullJob:
    request_id: str
    params: RemotePrefillParams
    hit_tokens: int
    load: tuple[tuple[tuple[int, int], ...], ...]   # per group: (logical block, local block)
    prompt_digest: bytes                            # of this request's prompt
    trace_context: tuple[tuple[str, str], ...] = ()  # the request's span (hybridpd/tracing.py)


class _EngineCalls:
    """PullEnd's calls, posted to the engine thread."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def complete_load(self, request_id: str) -> None:
        self._engine.call_soon(lambda: self._engine.engine.complete_load(request_id))

    def fail_load(self, request_id: str, error: Exception, recompute: bool) -> None:
        self._engine.call_soon(lambda: self._engine.engine.fail_load(request_id, error, recompute=recompute))

    def fail(self, request_id: str, error: Exception) -> None:
        self._engine.call_soon(lambda: self._engine.engine.fail(request_id, error))

    def release_load(self, request_id: str) -> None:
        self._engine.call_soon(lambda: self._engine.engine.scheduler.finish_load(request_id, ok=False))


class DecodeRole:
    def __init__(self, engine: AsyncEngine, transport: Transport, *, engine_id: str, compat_hash: str,
                 compat_fields: dict[str, str], config: KVTransferConfig, metrics: ConnectorMetrics,
                 tracer: Tracer | None = None) -> None:
        self.engine = engine
        self.transport = transport
        self.engine_id = engine_id
        self.compat_hash = compat_hash
        self.compat_fields = compat_fields
        self.config = config
        self.metrics = metrics
        self.tracer = tracer or NoTracer()
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task] = set()
        self._engine_calls = _EngineCalls(engine)
        self._credentials = config.tls.grpc_channel_credentials() if config.tls is not None else None
        self.peers = PeerCache(self._new_client, transport)
        self._sweeper = self._loop.create_task(self._sweep())

    # -- engine thread ------------------------------------------------------------------------------------------
    def start_load(self, seq: Sequence, hit_tokens: int, blocks: StepBlocks) -> None:
        assert seq.remote_prefill is not None
        job = PullJob(request_id=seq.request_id, params=seq.remote_prefill, hit_tokens=hit_tokens, load=blocks.load,
                      prompt_digest=prompt_digest(seq.prompt_token_ids), trace_context=seq.trace_context)
        self._loop.call_soon_threadsafe(self._spawn, job)

    def discard(self, seq: Sequence) -> None:
        assert seq.remote_prefill is not None
        self.release(seq.remote_prefill)

    def release(self, params: RemotePrefillParams) -> None:
        self._loop.call_soon_threadsafe(lambda: self._release_in_background(params, aborted=True))

    # -- event loop ---------------------------------------------------------------------------------------------
    def _spawn(self, job: PullJob) -> None:
        task = self._loop.create_task(self._run(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        self._sweeper.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(self._sweeper, *self._tasks, return_exceptions=True)
        await self.peers.close()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(_SWEEP_S)
            await self.peers.evict()

    def _new_client(self, address: Address) -> SideChannelClient:
        host, port = address
        return SideChannelClient(host, port, cluster_token=self.config.cluster_token,
                                 timeout_s=min(10.0, self.config.load_timeout_seconds), credentials=self._credentials)

    async def _run(self, job: PullJob) -> None:
        params = job.params
        attributes = {"gen_ai.request.id": job.request_id, "hybridpd.peer": params.peer,
                      "hybridpd.hit_tokens": job.hit_tokens, "hybridpd.remote_num_tokens": params.remote_num_tokens}
        with self.tracer.span("kv pull", dict(job.trace_context), attributes) as span:
            async with self.peers.use((params.remote_host, params.remote_port)) as peer:
                await self._run_with(job, peer, span.carrier())

    async def _run_with(self, job: PullJob, peer: Peer, trace: dict[str, str]) -> None:
        name = job.params.peer
        self.metrics.record_decode_hit(name, job.hit_tokens)
        end = PullEnd(job.request_id, self._engine_calls,
                      recompute=self.config.load_failure_policy is KVLoadFailurePolicy.RECOMPUTE)
        try:
            await asyncio.wait_for(self._pull(job, end, peer, trace), self.config.load_timeout_seconds)
        except asyncio.TimeoutError:
            timeout = self.config.load_timeout_seconds
            await self._failed(job, end, peer, KVTransferError(name, f"timed out after {timeout:g} s"))
        except KVTransferError as exc:
            await self._failed(job, end, peer, exc)
        except Exception as exc:  # a bug or an unexpected transport error: still the request's failure, not a hang
            log.exception("pull of %s from %s failed", job.request_id, name)
            await self._failed(job, end, peer, KVTransferError(name, f"{type(exc).__name__}: {exc}"))
        else:
            end.succeed()

    async def _failed(self, job: PullJob, end: PullEnd, peer: Peer, error: KVTransferError) -> None:
        """The pull failed: release the lease (unless it is another request's), then tell the engine."""
        self.metrics.record_failed_load(job.params.peer)
        log.warning("request %s: %s", job.request_id, error)
        if not isinstance(error, LeaseMismatchError):
            try:
                secret = job.params.remote_lease_secret or ""
                await asyncio.wait_for(peer.client.release(job.params.remote_request_id, aborted=True,
                                                           secret=secret), _RELEASE_TIMEOUT_S)
            except Exception:  # the peer may be gone; its lease then expires by itself
                pass
        end.fail(error)

    async def _peer(self, params: RemotePrefillParams, peer: Peer) -> str:
        """The transport name of the engine behind `params`' side channel, connecting to it on first use."""
        name = peer.transport_name
        if name is not None and name == params.remote_engine_id:
            return name
        meta = await peer.client.get_metadata(self.engine_id)
        if meta.compat_hash != self.compat_hash:
            raise KVTransferError(params.peer, "incompatible nodes: " + describe_mismatch(
                self.compat_fields, dict(meta.compat_fields)))
        if meta.engine_id != params.remote_engine_id:
            raise KVTransferError(params.peer, f"remote_engine_id {params.remote_engine_id!r} does not match the "
                                               f"engine serving there ({meta.engine_id!r})")
        layouts = [RegionLayout(base_addr=g.base_addr, page_size_bytes=g.page_size_bytes, num_blocks=g.num_blocks)
                   for g in meta.groups]
        try:
            self.transport.add_peer(meta.transport_name, meta.transport_metadata, layouts)
        except KVTransferError as exc:   # the transport names the peer's agent; the client knows its address
            raise KVTransferError(params.peer, exc.reason) from exc
        peer.transport_name = meta.transport_name
        return meta.transport_name

    def _reads(self, job: PullJob) -> list[BlockRead]:
        params, groups, leased = job.params, self.engine.engine.groups, job.params.remote_block_ids
        reads = []
        for g, (group, pairs) in enumerate(zip(groups, job.load)):
            start, end = group.spec.needed_span(params.remote_num_tokens)
            for logical, local in pairs:
                if not start <= logical < end:
                    raise KVTransferError(params.peer, f"group {g} needs block {logical}, outside the lease")
                reads.append(BlockRead(group_id=g, remote_block=leased[g][logical - start], local_block=local))
        return reads

    async def _pull(self, job: PullJob, end: PullEnd, peer: Peer, trace: dict[str, str]) -> None:
        params = job.params
        peer_name = await self._peer(params, peer)
        client = peer.client
        secret = params.remote_lease_secret or ""
        reads = self._reads(job)
        page_bytes = [g.page_size_bytes for g in self.engine.engine.groups]
        started, started_mono = time.perf_counter(), time.monotonic()
        try:
            handle = self.transport.start_read(peer_name, reads, params.remote_request_id.encode())
        except KVTransferError as exc:   # e.g. a block id outside the peer's pool: nothing was read
            raise KVTransferError(params.peer, exc.reason) from exc
        try:
            lease = await client.heartbeat(params.remote_request_id, secret, trace)
            self._check_lease(job, lease)
            live_until = await self._wait_read(handle, client, params, started + lease.seconds_left, trace)
        finally:
            if not self.transport.release(handle):
                self._keep_blocks_until_stopped(end, handle, peer_name)
        seconds = time.perf_counter() - started
        if started + seconds < live_until - _LEASE_MARGIN_S:
            self._release_in_background(params, aborted=False)
        elif not await client.release(params.remote_request_id, aborted=False, secret=secret):
            raise KVTransferError(params.peer, "the lease ended before the read finished (expired or released)")
        num_bytes = sum(page_bytes[r.group_id] for r in reads)
        self.metrics.record_read(params.peer, num_bytes, seconds)
        self.tracer.record("read", trace, started_mono, started_mono + seconds, {
            "hybridpd.read.bytes": num_bytes, "hybridpd.read.blocks": len(reads),
            "hybridpd.read.groups": len({r.group_id for r in reads})})

    @staticmethod
    def _check_lease(job: PullJob, lease: LeaseView) -> None:
        """The lease the heartbeat renewed is the one `kv_transfer_params` claims: its tokens, its prompt, its
        blocks (the READ already under way reads those blocks; on any difference its bytes are dropped)."""
        params = job.params
        if lease.num_tokens != params.remote_num_tokens:
            raise LeaseMismatchError(params.peer, f"the lease covers {lease.num_tokens} tokens, the request claims "
                                                  f"{params.remote_num_tokens}")
        if lease.prompt_digest != job.prompt_digest:
            raise LeaseMismatchError(params.peer,
                                     f"request {params.remote_request_id} was prefilled for another prompt")
        if lease.block_ids != params.remote_block_ids:
            raise LeaseMismatchError(params.peer, "remote_block_ids do not match the blocks leased for request "
                                                  f"{params.remote_request_id}")

    def _release_in_background(self, params: RemotePrefillParams, *, aborted: bool) -> None:
        """Nothing depends on the answer (the READ ended while the lease was surely live, or nothing is read): the
        Release only frees the peer's blocks early (if it is lost, the lease expires by itself)."""
        async def release() -> None:
            try:
                async with self.peers.use((params.remote_host, params.remote_port)) as peer:
                    await asyncio.wait_for(peer.client.release(params.remote_request_id, aborted=aborted,
                                                               secret=params.remote_lease_secret or ""),
                                           _RELEASE_TIMEOUT_S)
            except Exception as exc:
                log.debug("release of %s on %s: %s (the lease expires by itself)", params.remote_request_id,
                          params.peer, exc)

        task = self._loop.create_task(release())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _keep_blocks_until_stopped(self, end: PullEnd, handle: int, peer_name: str) -> None:
        """A READ we gave up on (timeout, cancel) could not be cancelled: it may still write into the request's
        blocks, so the pull's end waits until it has stopped (PullEnd keeps the blocks until then, and they are never
        hashed into the prefix cache). After DRAIN_LIMIT_S the peer is removed from the transport, which ends
        whatever it still has in flight."""
        end.read_outstanding()

        async def drain() -> None:
            deadline = self._loop.time() + DRAIN_LIMIT_S
            while self.transport.poll(handle) not in (TransferState.DONE, TransferState.FAILED):
                if self._loop.time() >= deadline:
                    log.error("a READ from %s did not stop within %g s: removing the peer from the transport",
                              peer_name, DRAIN_LIMIT_S)
                    self.peers.forget_transport(peer_name)
                    self.transport.remove_peer(peer_name)
                    break
                await asyncio.sleep(_POLL_MAX_S)
            self.transport.release(handle)
            end.read_stopped()

        task = self._loop.create_task(drain())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _wait_read(self, handle: int, client: SideChannelClient, params: RemotePrefillParams,
                         live_until: float, trace: dict[str, str]) -> float:
        """Poll the READ to its end, renewing the lease whenever half of its proven remaining time has passed;
        returns until when (perf_counter) the lease is proven live. If the pull's deadline cancels this wait,
        `_pull` cancels the READ or, failing that, keeps the blocks until it stops (`_keep_blocks_until_stopped`)."""
        delay = _POLL_FIRST_S
        renew_at = _renew_at(live_until)
        while True:
            state = self.transport.poll(handle)
            if state is TransferState.DONE:
                return live_until
            if state is TransferState.FAILED:
                raise KVTransferError(params.peer, "the READ failed (peer gone or link down)")
            if time.perf_counter() >= renew_at:
                sent = time.perf_counter()
                lease = await client.heartbeat(params.remote_request_id, params.remote_lease_secret or "", trace)
                live_until = sent + lease.seconds_left
                renew_at = _renew_at(live_until)
            await asyncio.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)


def _renew_at(live_until: float) -> float:
    """When to renew a lease proven live until `live_until` (perf_counter): half way there, at least 50 ms out."""
    now = time.perf_counter()
    return now + max(live_until - now, _MIN_RENEW_S) / 2
