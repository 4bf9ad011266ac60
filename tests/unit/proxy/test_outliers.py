"""The outlier detector's state machine: sequences of call outcomes, probe results and clock steps -> state."""

from __future__ import annotations

import pytest

from hybridpd.proxy.outliers import NodeState, OutlierDetector, OutlierPolicy

H, E, P = NodeState.HEALTHY, NodeState.EJECTED, NodeState.PROBING
POLICY = OutlierPolicy(threshold=3, base_ejection_s=2.0, max_ejection_s=8.0)


def run(events: str) -> list[NodeState]:
    """Events, space separated: `ok` / `fail` / `refused` (calls), `up` / `down` (probes), `+N` (N seconds pass).
    Returns the node's state after each event; after each, the node takes calls exactly when it is HEALTHY (the
    router reads the set of unavailable nodes, kept by events alone)."""
    now = [0.0]
    detector = OutlierDetector(POLICY, clock=lambda: now[0])
    states = []
    for event in events.split():
        if event.startswith("+"):
            now[0] += float(event[1:])
        elif event == "ok":
            detector.call_succeeded("n")
        elif event == "fail":
            detector.call_failed("n", "HTTP 500")
        elif event == "refused":
            detector.call_failed("n", "refused", conclusive=True)
        elif event == "up":
            detector.probe_passed("n")
        elif event == "down":
            detector.probe_failed("n", "timeout")
        states.append(detector.state("n"))
        assert detector.available("n") is (states[-1] is NodeState.HEALTHY), events
        assert ("n" in detector.unavailable) is (states[-1] is not NodeState.HEALTHY), events
    return states


@pytest.mark.parametrize("events, expected_last, why", [
    ("fail fail", H, "below the threshold"),
    ("fail fail fail", E, "three consecutive failed calls eject"),
    ("fail fail ok fail fail", H, "a success in between starts the count over"),
    ("down down down", E, "three failed probes eject"),
    ("fail fail down down", H, "calls and probes are counted apart"),
    ("fail down fail down fail", E, "the third consecutive failed call ejects, probes in between or not"),
    ("refused", E, "a refused connection ejects at once"),
    ("refused +1 up", E, "a probe passing during the ejection time changes nothing"),
    ("refused +2", P, "after the ejection time: probing, still no calls"),
    ("refused +2 up", H, "probing, a probe passes: back in rotation"),
    ("refused +2 ok", P, "a late call's success does not return it"),
    ("refused +2 down", E, "probing, a probe fails: ejected again"),
    ("refused +2 down +3", E, "the second ejection lasts twice as long (4 s)"),
    ("refused +2 down +4", P, "... and ends after 4 s"),
    ("refused +2 down +4 down +7", E, "the third lasts 8 s"),
    ("refused +2 down +4 down +8 down +8", P, "capped at max_ejection_s (8 s, not 16)"),
    ("refused +2 up +8 up refused +1.9", E, "healthy for max_ejection_s: the ejection time starts over..."),
    ("refused +2 up +8 up refused +2", P, "... at the base again"),
    ("refused +2 up +1 up refused +2", E, "not yet stable: the second ejection is 4 s"),
])
def test_outlier_state_machine(events, expected_last, why):
    assert run(events)[-1] is expected_last, why


def test_only_healthy_nodes_are_available_and_records_of_departed_nodes_are_dropped():
    detector = OutlierDetector(POLICY, clock=lambda: 0.0)
    detector.call_failed("a", "refused", conclusive=True)
    detector.call_succeeded("b")
    assert not detector.available("a") and detector.available("b")
    assert detector.health("a").to_json()["state"] == "ejected"
    assert detector.health("a").last_error == "refused"
    assert detector.unavailable == {"a"}
    detector.retain({"b"})
    assert detector.available("a") and not detector.unavailable   # a node that left and comes back starts with a clean record
    assert detector.num_ejections == 1


@pytest.mark.parametrize("policy", [dict(threshold=0), dict(base_ejection_s=0), dict(base_ejection_s=9,
                                                                                     max_ejection_s=8)])
def test_a_policy_out_of_range_is_refused(policy):
    with pytest.raises(ValueError):
        OutlierPolicy(**policy)
