"""The front's watchdog over its engine process: heartbeats and step progress -> verdict."""

from __future__ import annotations

import pytest

from hybridpd.server.watchdog import EngineVerdict, Watchdog, WatchdogBounds

A, S, T, D = EngineVerdict.ALIVE, EngineVerdict.SILENT, EngineVerdict.STALLED, EngineVerdict.DEAD
BOUNDS = WatchdogBounds(silent_after=10.0, stall_after=30.0)


def verdict(events: str) -> EngineVerdict:
    """Events: `beat:STEPS:busy|idle`, `+N` (N seconds pass), `dead`."""
    now = [0.0]
    dog = Watchdog(BOUNDS, clock=lambda: now[0])
    for event in events.split():
        if event.startswith("+"):
            now[0] += float(event[1:])
        elif event == "dead":
            dog.dead("the engine process exited")
        else:
            _, steps, state = event.split(":")
            dog.beat(int(steps), state == "busy")
    return dog.verdict()[0]


@pytest.mark.parametrize("events, expected, why", [
    ("beat:0:idle", A, "a first beat"),
    ("+9", A, "not yet silent at start-up"),
    ("beat:0:idle +11", S, "no beat for more than the bound: stopped or starved"),
    ("beat:0:idle +11 beat:0:idle", A, "beats again (SIGCONT): alive"),
    ("beat:1:busy +10 beat:1:busy +10 beat:1:busy +10 beat:1:busy +1", T, "beats, work, no step for 31 s"),
    ("beat:1:busy +10 beat:2:busy +10 beat:3:busy +10 beat:4:busy +1", A, "steps move on"),
    ("beat:1:idle +10 beat:1:idle +10 beat:1:idle +10 beat:1:idle +1", A, "idle: no step is due"),
    ("beat:1:busy +10 beat:1:busy +10 beat:1:busy +10 beat:1:busy +1 beat:2:busy", A, "a long step ended"),
    ("beat:1:idle dead", D, "the link closed"),
    ("dead beat:2:busy", D, "a dead engine stays dead"),
])
def test_watchdog_verdict(events, expected, why):
    assert verdict(events) is expected, why


def test_bounds_out_of_range_are_refused():
    with pytest.raises(ValueError):
        WatchdogBounds(silent_after=0.5)
    with pytest.raises(ValueError):
        WatchdogBounds(stall_after=0)
