"""Every interleaving of a pull's end: the verdict (ok / failed), a READ that could not be cancelled, its stop, and
repeated or late calls. In each, the engine hears exactly one final verdict, and never one that frees the blocks
while the READ may still write into them."""

from __future__ import annotations

import itertools

import pytest

from hybridpd.decode_node.pull_end import PullEnd, PullState

ERROR = RuntimeError("pull failed")
FINAL = {"complete_load", "fail_load", "release_load"}      # calls after which the blocks may be reused or freed


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.read_running = False

    def _record(self, *call) -> None:
        if call[0] in FINAL:
            assert not self.read_running, f"{call[0]} while a READ may still write into the blocks"
        self.calls.append(call)

    def complete_load(self, rid):
        self._record("complete_load", rid)

    def fail_load(self, rid, error, recompute):
        self._record("fail_load", rid, recompute)

    def fail(self, rid, error):
        self._record("fail", rid)

    def release_load(self, rid):
        self._record("release_load", rid)


def _run(events: tuple[str, ...], recompute: bool) -> Recorder:
    engine = Recorder()
    end = PullEnd("r", engine, recompute=recompute)
    for event in events:
        if event == "stuck":
            engine.read_running = True
            end.read_outstanding()
        elif event == "stopped":
            engine.read_running = False
            end.read_stopped()
        elif event == "ok":
            end.succeed()
        else:
            end.fail(ERROR)
    return engine


def _orders():
    """Every order of: a verdict (ok or failed, maybe given twice), and maybe a stuck READ that then stops."""
    for verdicts in (("ok",), ("failed",), ("failed", "failed"), ("ok", "failed"), ("failed", "ok")):
        for stuck in (False, True):
            items = list(verdicts) + (["stuck", "stopped"] if stuck else [])
            for order in set(itertools.permutations(items)):
                if stuck and order.index("stuck") > order.index("stopped"):
                    continue
                if "ok" in verdicts and stuck and order.index("ok") < order.index("stuck") and verdicts[0] == "ok":
                    continue  # an ok verdict means the READ finished: it cannot get stuck afterwards
                yield order


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("order", sorted(_orders()))
def test_exactly_one_final_verdict_and_never_while_a_read_runs(order, recompute):
    engine = _run(order, recompute)
    finals = [c for c in engine.calls if c[0] in FINAL]
    assert len(finals) == 1, engine.calls
    first_verdict = next(e for e in order if e in ("ok", "failed"))
    if first_verdict == "ok":
        assert engine.calls == [("complete_load", "r")]
    elif ("stuck" in order and order.index("stuck") < order.index(first_verdict) < order.index("stopped")
          and not recompute):
        assert engine.calls == [("fail", "r"), ("release_load", "r")]   # the client hears before the READ stops
    else:
        assert engine.calls == [("fail_load", "r", recompute)]


def test_the_state_machine_ends_once():
    engine = Recorder()
    end = PullEnd("r", engine, recompute=False)
    end.read_outstanding()
    assert end.state is PullState.READ_STUCK
    end.fail(ERROR)
    assert end.state is PullState.READ_STUCK and engine.calls == [("fail", "r")]
    end.read_stopped()
    assert end.state is PullState.ENDED
    end.read_outstanding()
    end.read_stopped()
    end.succeed()
    assert engine.calls == [("fail", "r"), ("release_load", "r")]
