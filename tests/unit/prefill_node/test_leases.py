"""LeaseTable with a fake clock: every lease is freed exactly once, a late call gets a precise reason, and only the
holder of a lease (its secret) may renew or release it."""

from __future__ import annotations

import pytest

from hybridpd.prefill_node.leases import LeaseTable

BLOCKS = ((1, 2), (), (9,))
LEASE_S = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


class Holder:
    """The table as decoders that hold every lease they were handed use it (each presents its lease's secret)."""

    def __init__(self, table: LeaseTable) -> None:
        self.table = table
        self.secrets: dict[str, str] = {}

    def add(self, request_id: str, blocks, num_tokens: int):
        lease = self.table.add(request_id, blocks, num_tokens)
        self.secrets[request_id] = lease.secret
        return lease

    def renew(self, request_id: str):
        return self.table.renew(request_id, self.secrets.get(request_id, ""))

    def release(self, request_id: str):
        return self.table.release(request_id, self.secrets.get(request_id, ""))

    def __len__(self) -> int:
        return len(self.table)

    def __getattr__(self, name: str):
        return getattr(self.table, name)


@pytest.fixture
def table(clock: FakeClock) -> Holder:
    return Holder(LeaseTable(LEASE_S, clock))


def test_add_holds_exactly_what_it_was_given(table, clock):
    lease = table.add("r", BLOCKS, 33)
    assert (lease.request_id, lease.block_ids, lease.num_tokens, lease.expiry) == ("r", BLOCKS, 33, 1010.0)
    assert len(table) == 1
    assert table.next_expiry() == 1010.0


@pytest.mark.parametrize("advance, expected_expiry", [(0.0, 1010.0), (4.0, 1014.0), (9.999, 1019.999)])
def test_renew_extends_from_now(table, clock, advance, expected_expiry):
    table.add("r", BLOCKS, 33)
    clock.now += advance
    lease = table.renew("r")
    assert lease.expiry == pytest.approx(expected_expiry)
    assert lease.block_ids == BLOCKS
    assert table.next_expiry() == pytest.approx(expected_expiry)
    clock.now = expected_expiry - 0.001
    assert table.expire_due() == []          # the renewal kept it alive past its first expiry


@pytest.mark.parametrize("setup, reason", [
    ([], "no lease is held"),
    ([("add",), ("advance", LEASE_S)], "has expired"),
    ([("add",), ("advance", LEASE_S + 5)], "has expired"),
    ([("add",), ("release",)], "already released"),
    ([("add",), ("advance", LEASE_S), ("sweep",)], "already expired"),
    ([("add",), ("drain",)], "already released"),
])
def test_renew_says_why_it_cannot(table, clock, setup, reason):
    for action, *args in setup:
        if action == "add":
            table.add("r", BLOCKS, 33)
        elif action == "advance":
            clock.now += args[0]
        elif action == "release":
            table.release("r")
        elif action == "sweep":
            table.expire_due()
        elif action == "drain":
            table.drain()
    with pytest.raises(LookupError, match=reason):
        table.renew("r")


def test_release_returns_the_live_lease_once(table, clock):
    table.add("r", BLOCKS, 33)
    clock.now += LEASE_S - 1
    lease = table.release("r")
    assert lease is not None and lease.block_ids == BLOCKS
    assert table.release("r") is None
    assert len(table) == 0 and table.next_expiry() is None
    clock.now += 100
    assert table.expire_due() == []
    assert table.num_expired == 0


def test_release_of_unknown_is_none(table):
    assert table.release("never") is None


def test_release_after_expiry_is_none_and_the_sweep_frees_once(table, clock):
    table.add("r", BLOCKS, 33)
    clock.now += LEASE_S                       # expiry is inclusive: due at exactly expiry
    assert table.release("r") is None          # too late: the decoder must not trust its READ
    due = table.expire_due()
    assert [lease.request_id for lease in due] == ["r"]
    assert table.expire_due() == []
    assert table.release("r") is None
    assert table.num_expired == 1 and len(table) == 0


def test_expire_due_takes_only_the_due_ones(table, clock):
    table.add("a", BLOCKS, 1)
    clock.now += 3
    table.add("b", BLOCKS, 2)
    clock.now += 3
    table.add("c", BLOCKS, 3)
    table.renew("a")                           # a: 1016, b: 1013, c: 1016
    clock.now = 1013.0
    assert [lease.request_id for lease in table.expire_due()] == ["b"]
    assert table.next_expiry() == 1016.0
    clock.now = 1016.0
    assert sorted(lease.request_id for lease in table.expire_due()) == ["a", "c"]
    assert table.num_expired == 3 and len(table) == 0


def test_drain_ends_every_lease_once(table, clock):
    for rid in ("a", "b", "c"):
        table.add(rid, BLOCKS, 5)
    table.release("b")
    drained = table.drain()
    assert sorted(lease.request_id for lease in drained) == ["a", "c"]
    assert table.drain() == [] and len(table) == 0
    clock.now += 100
    assert table.expire_due() == []
    assert all(table.release(rid) is None for rid in ("a", "b", "c"))


def test_a_reused_request_id_is_leased_again(table, clock):
    table.add("r", BLOCKS, 33)
    table.release("r")
    table.add("r", ((4,), (), (5,)), 20)
    assert table.renew("r").block_ids == ((4,), (), (5,))
    assert table.release("r") is not None


@pytest.mark.parametrize("ids, forgotten, remembered", [
    (["a", "b", "c", "d", "e"], ["a", "b"], ["c", "d", "e"]),
    (["a", "b", "a", "c", "d"], ["b"], ["a", "c", "d"]),      # a reused id is the newest again
])
def test_the_memory_of_finished_leases_is_bounded_and_keeps_the_newest(clock, ids, forgotten, remembered):
    table = Holder(LeaseTable(LEASE_S, clock, remembered=3))
    for rid in ids:
        table.add(rid, BLOCKS, 1)
        table.release(rid)
    for rid in forgotten:
        with pytest.raises(LookupError, match="no lease is held"):
            table.renew(rid)
    for rid in remembered:
        with pytest.raises(LookupError, match="already released"):
            table.renew(rid)


@pytest.mark.parametrize("presented", ["", "0" * 32, "not-the-secret"])
def test_only_the_holder_renews_or_releases(table, clock, presented):
    """Another request carrying this one's remote_request_id (tampered or replayed params) cannot end its lease."""
    lease = table.add("r", BLOCKS, 33)
    assert len(lease.secret) == 32 and lease.secret != presented
    with pytest.raises(LookupError, match="held by another request"):
        table.table.renew("r", presented)
    assert table.table.release("r", presented) is None
    assert len(table) == 1                      # still held: the honest decoder goes on
    clock.now += 1
    assert table.renew("r").expiry == pytest.approx(1011.0)
    assert table.release("r") is not None


def test_every_lease_has_its_own_secret(table):
    secrets = {table.add(rid, BLOCKS, 1).secret for rid in ("a", "b", "c")}
    assert len(secrets) == 3


def test_leases_expire_on_the_monotonic_clock_and_the_wire_gets_unix_time():
    """A wall-clock step (NTP, a suspended guest) must not end a lease early: a node's table runs on
    time.monotonic(), and `remote_lease_expiry` / a heartbeat's expiry are converted to unix time for the wire."""
    import time

    from prometheus_client import CollectorRegistry

    from hybridpd.connector.metrics import ConnectorMetrics
    from hybridpd.prefill_node.role import PrefillRole

    role = PrefillRole(None, None, engine_id="p", advertised_host="127.0.0.1", side_channel_port=1,
                       lease_seconds=30.0, metrics=ConnectorMetrics(CollectorRegistry()))
    assert role.leases.clock is time.monotonic
    now = [1000.0]   # a monotonic clock far from unix time
    table = LeaseTable(30.0, clock=lambda: now[0])
    lease = table.add("r", ((1,),), 16)
    assert abs(table.unix_time(lease.expiry) - (time.time() + 30.0)) < 1.0
    now[0] += 29.0
    assert table.expire_due() == []
    now[0] += 2.0
    assert [ended.request_id for ended in table.expire_due()] == ["r"]
