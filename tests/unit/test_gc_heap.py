"""Start-up's heap frozen: garbage collected first (never frozen for good), frozen objects handed back after a block,
and the proxy's process freezing once its app has started."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from hybridpd.gc_heap import freeze_startup_heap, freeze_startup_heap_on_start, startup_heap_frozen
from hybridpd.proxy import main as proxy_main


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _garbage_cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture(autouse=True)
def _unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_freezing_collects_the_garbage_first_and_freezes_what_lives():
    gone = _garbage_cycle()
    alive = _Node()
    freeze_startup_heap()
    assert gone() is None                 # collected, not frozen with the rest
    assert gc.get_freeze_count() > 0
    assert alive.other is None            # nothing else changes for a live object


def test_a_frozen_block_hands_its_objects_back_to_the_collector():
    with startup_heap_frozen():
        assert gc.get_freeze_count() > 0
        gone = _garbage_cycle()
        gc.collect()
        assert gone() is None             # what the block makes is collected as before
    assert gc.get_freeze_count() == 0


def test_a_frozen_block_hands_them_back_when_it_raises():
    with pytest.raises(RuntimeError):
        with startup_heap_frozen():
            raise RuntimeError("the run failed")
    assert gc.get_freeze_count() == 0


def test_the_proxy_process_freezes_once_its_app_has_started(monkeypatch):
    started = []
    monkeypatch.setattr(proxy_main.web, "run_app", lambda app, **kwargs: started.append(app))
    assert proxy_main.main(["--prefiller-host", "127.0.0.1", "--decoder-host", "127.0.0.1"]) == 0
    (app,) = started
    assert app.on_startup[-1] is freeze_startup_heap_on_start   # last: after the app's own contexts started
    asyncio.run(app.on_startup[-1](app))
    assert gc.get_freeze_count() > 0
