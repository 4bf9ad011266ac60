"""DecodeRole over the fake transport: a pull that succeeds, one whose peer's transport metadata does not load (its
error names the peer's address), whose READ fails, and one that times out on a stalled
READ NIXL refuses to cancel, with the READ finishing before, during or after the lease release. In each the engine
hears exactly one final verdict, never while the READ may still write into the request's blocks, and the request
is never left without one (a drain that finished during the release once left it hanging).
Then the heartbeat that runs beside the READ: a lease it contradicts drops the READ, a READ inside the lease's proven
lifetime does not wait for the Release, and without that proof the Release's answer decides."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry

from hybridpd.config import KVLoadFailurePolicy, KVTransferConfig
from hybridpd.connector.fake_transport import FakeFabric, FakeTransport
from hybridpd.connector.lease_view import LeaseView, prompt_digest
from hybridpd.connector.metrics import ConnectorMetrics
from hybridpd.decode_node.role import DecodeRole, PullJob
from hybridpd.decode_node.peers import PeerCache
from hybridpd.engine.kv_cache.spec import FullAttentionSpec, KVCacheGroup
from hybridpd.engine.transfer_params import RemotePrefillParams
from hybridpd.errors import KVTransferError

BLOCK, NUM_TOKENS = 4, 11
GROUPS = (KVCacheGroup(spec=FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=4, dtype=torch.float32),
                       layer_ids=(0,)),)
PROMPT = list(range(NUM_TOKENS + 1))
FINAL = {"complete_load", "fail_load", "release_load"}


class FakeCore:
    def __init__(self, transport: FakeTransport) -> None:
        self.groups = GROUPS
        self.transport = transport
        self.calls: list[str] = []
        self.errors: list[Exception] = []
        self.scheduler = self

    def _record(self, call: str) -> None:
        if call in FINAL:  # the blocks may be freed or reused: no READ into them may still run
            assert not self.transport.num_running(), f"{call} while the READ still runs"
        self.calls.append(call)

    def complete_load(self, rid):
        self._record("complete_load")

    def fail_load(self, rid, error, recompute):
        self.errors.append(error)
        self._record("fail_load")

    def fail(self, rid, error):
        self._record("fail")

    def finish_load(self, rid, ok):
        self._record("release_load")


class FakeEngine:
    def __init__(self, core: FakeCore) -> None:
        self.engine = core

    def call_soon(self, fn) -> None:
        fn()


class FakeClient:
    """The prefill node's side channel: a live lease over blocks 1..3; `release` may wait for the test. The lease
    says no `seconds_left` unless a test sets it (then the Release's answer, `live`, decides)."""

    def __init__(self) -> None:
        self.release_gate: asyncio.Event | None = None
        self.releases: list[bool] = []
        self.lease = LeaseView(expiry=time.time() + 60, block_ids=((1, 2, 3),), num_tokens=NUM_TOKENS,
                               prompt_digest=prompt_digest(PROMPT[:NUM_TOKENS]))
        self.lost: str | None = None
        self.live = True

    async def heartbeat(self, request_id, secret, trace=None):
        if self.lost is not None:
            raise KVTransferError("127.0.0.1:1", f"lease lost: {self.lost}")
        return self.lease

    async def release(self, request_id, aborted, secret):
        self.releases.append(aborted)
        if self.release_gate is not None:
            await self.release_gate.wait()
        return self.live

    async def close(self):
        self.closed = True

    async def get_metadata(self, requester_engine_id):
        """The prefill node "P" of the fake fabric, as its side channel describes it."""
        layouts = self.prefill.local_layouts()
        groups = [SimpleNamespace(base_addr=g.base_addr, page_size_bytes=g.page_size_bytes, num_blocks=g.num_blocks)
                  for g in layouts]
        return SimpleNamespace(compat_hash="h", compat_fields={}, engine_id="P", groups=groups, transport_name="P",
                               transport_metadata=self.prefill.local_metadata())


def _transport(name: str, fabric: FakeFabric) -> FakeTransport:
    transport = FakeTransport(name, fabric)
    transport.register([torch.zeros(8, GROUPS[0].page_size_bytes, dtype=torch.int8)])
    return transport


async def _role(policy=KVLoadFailurePolicy.FAIL, timeout=0.2):
    fabric = FakeFabric()
    prefill, decode = _transport("P", fabric), _transport("D", fabric)
    decode.add_peer("P", prefill.local_metadata(), prefill.local_layouts())
    core = FakeCore(decode)
    role = DecodeRole(FakeEngine(core), decode, engine_id="D", compat_hash="h", compat_fields={},
                      config=KVTransferConfig(load_timeout_seconds=timeout, load_failure_policy=policy),
                      metrics=ConnectorMetrics(CollectorRegistry()))
    client = FakeClient()
    client.prefill = prefill
    role.peers = PeerCache(lambda address: client, decode)
    params = RemotePrefillParams(remote_engine_id="P", remote_request_id="p-1", remote_block_ids=((1, 2, 3),),
                                 remote_host="127.0.0.1", remote_port=1, remote_num_tokens=NUM_TOKENS,
                                 first_token_id=3)
    job = PullJob(request_id="r", params=params, hit_tokens=0, load=(((0, 4), (1, 5), (2, 6)),),
                  prompt_digest=prompt_digest(PROMPT[:NUM_TOKENS]))
    return role, fabric, core, client, job


async def _settle(role: DecodeRole) -> None:
    while role._tasks:
        await asyncio.gather(*list(role._tasks), return_exceptions=True)


async def test_a_pull_that_succeeds_completes_the_load():
    role, fabric, core, client, job = await _role()
    await role._run(job)
    assert core.calls == ["complete_load"] and client.releases == [False]


@pytest.mark.parametrize("policy", list(KVLoadFailurePolicy))
async def test_a_failed_read_fails_the_load_once(policy):
    role, fabric, core, client, job = await _role(policy)
    fabric.set_failing("P")
    await role._run(job)
    assert core.calls == ["fail_load"] and client.releases == [True]


async def test_a_peer_whose_transport_metadata_does_not_load_fails_naming_its_address(monkeypatch):
    """The transport names a peer by its agent (a prefill node killed between its metadata and the load); the
    request's error names the side channel's address, as every other pull failure does: what the proxy, a client
    and an operator can act on."""
    role, fabric, core, client, job = await _role()
    described = await client.get_metadata("D")

    async def gone(requester_engine_id):
        return SimpleNamespace(**{**vars(described), "transport_name": "P-restarted"})

    monkeypatch.setattr(client, "get_metadata", gone)
    await role._run(job)
    assert core.calls == ["fail_load"] and client.releases == [True]
    [error] = core.errors
    assert isinstance(error, KVTransferError) and error.peer == "127.0.0.1:1", error
    assert "bad transport metadata" in error.reason


@pytest.mark.parametrize("policy", list(KVLoadFailurePolicy))
@pytest.mark.parametrize("read_ends", ["before_release", "during_release", "after_release"])
@pytest.mark.parametrize("read_outcome", ["done", "failed"])
async def test_a_timed_out_read_that_cannot_be_cancelled(policy, read_ends, read_outcome):
    role, fabric, core, client, job = await _role(policy)
    fabric.set_stalled("P")
    fabric.set_uncancellable("P")
    client.release_gate = asyncio.Event()

    def end_read() -> None:
        if read_outcome == "failed":
            fabric.set_failing("P")
        fabric.set_stalled("P", False)

    run = asyncio.create_task(role._run(job))
    while not client.releases:          # the pull timed out; its lease release is under way
        await asyncio.sleep(0.01)
    if read_ends == "before_release":
        end_read()
        while role._tasks - {run}:      # the drain saw the READ stop
            await asyncio.sleep(0.01)
        client.release_gate.set()
    elif read_ends == "during_release":
        end_read()
        await asyncio.sleep(0.05)
        client.release_gate.set()
    else:
        client.release_gate.set()
        await run
        assert not [c for c in core.calls if c in FINAL]   # the READ still runs: nothing final yet
        end_read()
    await run
    await _settle(role)
    finals = [c for c in core.calls if c in FINAL]
    assert len(finals) == 1, core.calls
    if read_ends == "after_release" and policy is KVLoadFailurePolicy.FAIL:
        assert core.calls == ["fail", "release_load"]      # the client heard before the READ stopped
    else:
        assert core.calls == ["fail_load"]


async def test_a_read_within_the_proven_lease_does_not_wait_for_the_release():
    role, fabric, core, client, job = await _role()
    client.lease = dataclasses.replace(client.lease, seconds_left=60.0)
    client.release_gate = asyncio.Event()     # the Release would never answer
    await role._run(job)
    assert core.calls == ["complete_load"] and client.releases == [False]
    client.release_gate.set()
    await _settle(role)
    assert core.calls == ["complete_load"]


@pytest.mark.parametrize("seconds_left", [0.0, 0.1])   # the peer did not say; less than the margin
@pytest.mark.parametrize("live", [True, False])
async def test_without_a_proven_lease_the_release_decides(seconds_left, live):
    role, fabric, core, client, job = await _role()
    client.lease = dataclasses.replace(client.lease, seconds_left=seconds_left)
    client.live = live
    await role._run(job)
    await _settle(role)
    assert core.calls == (["complete_load"] if live else ["fail_load"])
    assert client.releases[0] is False


@pytest.mark.parametrize("contradiction", [
    {"num_tokens": NUM_TOKENS - 1},
    {"prompt_digest": prompt_digest(PROMPT[1:NUM_TOKENS + 1])},
    {"block_ids": ((1, 2, 4),)},
])
async def test_a_lease_that_contradicts_the_params_drops_the_read_and_leaves_the_lease_to_its_holder(contradiction):
    """The lease is another request's (tampered or replayed params): releasing it would fail the request that does
    hold it ("lease lost ... already released"). It is left alone: its holder releases it, or it expires."""
    role, fabric, core, client, job = await _role()
    client.lease = dataclasses.replace(client.lease, seconds_left=60.0, **contradiction)
    await role._run(job)
    await _settle(role)
    assert core.calls == ["fail_load"] and client.releases == []


@pytest.mark.parametrize("cancellable", [True, False])
async def test_a_lease_lost_while_the_read_runs_fails_once_after_the_read_stops(cancellable):
    role, fabric, core, client, job = await _role()
    client.lost = "expired"
    fabric.set_stalled("P")
    if not cancellable:
        fabric.set_uncancellable("P")
    run = asyncio.create_task(role._run(job))
    await run
    if not cancellable:
        assert not [c for c in core.calls if c in FINAL]   # the READ still runs: nothing final yet
        fabric.set_stalled("P", False)
    await _settle(role)
    # FAIL policy: the client hears at once; the blocks wait for the READ to stop
    assert core.calls == (["fail_load"] if cancellable else ["fail", "release_load"]) and client.releases == [True]


async def test_a_request_that_ends_before_its_pull_releases_the_lease_and_reads_nothing():
    """`discard` (the engine thread's call when a remotely prefilled request ends before its pull: its first token
    ended it, or it was aborted while waiting) sends an aborted Release, and no READ starts."""
    role, fabric, core, client, job = await _role()
    seq = dataclasses.make_dataclass("Seq", ["remote_prefill"])(remote_prefill=job.params)
    role.discard(seq)
    await asyncio.sleep(0)          # the release is posted to the loop from the engine thread
    await _settle(role)
    assert client.releases == [True] and core.calls == [] and not role.transport.num_running()


async def test_a_read_that_never_stops_is_waited_for_boundedly_then_its_peer_is_removed(monkeypatch):
    """An uncancellable READ that never ends: after DRAIN_LIMIT_S the peer is removed from the transport (which fails
    what it has in flight), the blocks go back once, and the next pull from that address connects again."""
    monkeypatch.setattr("hybridpd.decode_node.role.DRAIN_LIMIT_S", 0.2)
    role, fabric, core, client, job = await _role()
    fabric.set_stalled("P")
    fabric.set_uncancellable("P")
    await role._run(job)
    await _settle(role)
    assert core.calls == ["fail", "release_load"], core.calls
    assert not role.transport.num_running()
    fabric.set_stalled("P", False)
    await role._run(dataclasses.replace(job, request_id="r2"))
    assert core.calls[-1] == "complete_load"
