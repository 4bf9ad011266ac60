"""The local cluster's supervisor with fake children and a fake clock: exit causes, backoff, policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridpd.launcher.errors import ChildExitedError
from hybridpd.launcher.supervisor import MAX_BACKOFF_S, STABLE_AFTER_S, RestartPolicy, Supervisor, exit_cause


class FakeChild:
    def __init__(self, name: str, pid: int) -> None:
        self.name, self.pid, self.code = name, pid, None
        self.log_path = Path(f"/tmp/{name}.log")

    def returncode(self):
        return self.code

    def log_tail(self) -> str:
        return "the last lines"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("code, cause", [
    (-9, "killed by SIGKILL"), (-15, "killed by SIGTERM"), (1, "exited with code 1"), (0, "exited with code 0"),
])
def test_exit_cause_names_the_signal_or_code(code, cause):
    assert exit_cause(code) == cause


def test_restarts_with_doubling_backoff_that_resets_once_stable():
    clock, lines, spawned = Clock(), [], []
    child = FakeChild("prefill-0", 10)

    def respawn(old):
        new = FakeChild(old.name, old.pid + 1)
        spawned.append(new)
        return new

    supervisor = Supervisor([child], RestartPolicy.ON_FAILURE, respawn, clock=clock, report=lines.append)
    delays = []
    current = child
    for _ in range(7):
        current.code = -9
        supervisor.check()                      # noticed: backing off
        died = clock.now
        while not spawned or spawned[-1] is current:
            clock.now += 0.5
            supervisor.check()
        delays.append(clock.now - died)
        current = spawned[-1]
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, MAX_BACKOFF_S, MAX_BACKOFF_S]
    assert supervisor.restarts("prefill-0") == 7
    assert "prefill-0 killed by SIGKILL; restarting it in 1 s" in lines[0]
    clock.now += STABLE_AFTER_S                 # a minute up: the next exit waits the first backoff again
    supervisor.check()
    current.code = 3
    supervisor.check()
    assert "exited with code 3; restarting it in 1 s" in lines[-1]


def test_policy_never_fails_on_the_first_exit():
    child = FakeChild("decode-0", 20)
    supervisor = Supervisor([child], RestartPolicy.NEVER, lambda c: pytest.fail("no restart"), clock=Clock(),
                            report=lambda line: None)
    supervisor.check()
    child.code = -9
    with pytest.raises(ChildExitedError, match="decode-0"):
        supervisor.check()
