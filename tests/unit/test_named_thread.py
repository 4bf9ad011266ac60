"""A `NamedThread` is its name to the operating system too (what top -H, ps -L and /proc show), cut to the kernel's
15 bytes (the engine process and the storage tier's writer naming themselves: tests/e2e/test_engine_process.py and
test_writer_process.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from hybridpd.named_thread import NamedThread

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")


def _comm_of(native_id: int) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


@pytest.mark.parametrize("name, shown", [
    ("kv-events", "kv-events"),
    ("kv-offload-scanner", "kv-offload-scan"),   # 15 bytes at most
])
def test_a_named_thread_is_its_name_to_the_operating_system(name, shown):
    seen: list[str] = []
    thread = NamedThread(target=lambda: seen.append(_comm_of(threading.get_native_id())), name=name)
    thread.start()
    thread.join()
    assert seen == [shown]
    assert thread.name == name   # Python's name is whole


def test_a_plain_thread_is_not_renamed_and_the_main_thread_keeps_its_name():
    main = _comm_of(threading.get_native_id())
    seen: list[str] = []
    thread = threading.Thread(target=lambda: seen.append(_comm_of(threading.get_native_id())), name="plain")
    thread.start()
    thread.join()
    assert seen == [main] and main != "plain"
