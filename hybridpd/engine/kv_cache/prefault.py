"""Page faults of the KV pool taken ahead of time, on a thread of their own.

The pool's memory is touched only when a block is first written (storage.py), and its mappings are advised onto
huge pages: on the AMD EPYC guest benchmarks/README.md names, the write that faults in a 2 MiB page took ~1 ms of
the step that made it, and a decode node's steps in which a pulled request joined took 14 ms at the median against
10 with the pool's memory already there (in-process, the small preset). A fresh node pays that for every page it
fills, for minutes, and a block whose bytes went to another group (`KVCacheStorage.release`) pays it again.

So after each step the engine names the blocks each pool will hand out next (`BlockPool.upcoming`), and this
thread asks the kernel to fault in the 2 MiB regions they lie in, and the region after (`MADV_POPULATE_WRITE`:
the faults of writing each page, without writing). The step that writes them finds them there. It never changes a
byte, so a region the engine is writing meanwhile is safe, and a region released meanwhile is either populated
again or not: both read as zeros. The call is made through ctypes, which lets the GIL go while the kernel works.

Memory populated ahead is not yet counted by the budget: per group the regions of its next few blocks and the one
after (once blocks have been given back, their pages in those regions too: a region is populated whole).
Where the kernel lacks `MADV_POPULATE_WRITE` (before Linux 5.14) nothing is populated and faults stay with the step.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import queue
import threading

from hybridpd.named_thread import NamedThread

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23   # linux/mman.h, since Linux 5.14
REGION_BYTES = 2 << 20     # a huge page on x86-64 and arm64 with 4 KiB pages


class Prefaulter:
    """The thread runs while there is work, and exits after IDLE_EXIT_S without any (the next request starts it
    again), so an engine that is dropped without `close` leaves no thread behind for long."""

    IDLE_EXIT_S = 2.0

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        self._queue: queue.Queue[tuple[int, int] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.supported = True
        self.populated_bytes = 0

    def populate(self, address: int, length: int) -> None:
        """Fault in [address, address + length) (page-aligned) on the thread, later."""
        if not self.supported:
            return
        with self._lock:
            self._queue.put((address, length))
            if self._thread is None:
                self._thread = NamedThread(target=self._run, name="kv-prefault", daemon=True)
                self._thread.start()

    def wait_idle(self) -> None:
        """Until everything asked so far is populated (tests)."""
        self._queue.join()

    def close(self) -> None:
        with self._lock:
            thread = self._thread
            if thread is not None:
                self._queue.put(None)
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self.IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            try:
                if item is None:
                    with self._lock:
                        self._thread = None
                    return
                if self.supported:
                    self._madvise(*item)
            finally:
                self._queue.task_done()

    def _madvise(self, address: int, length: int) -> None:
        if self._libc.madvise(address, length, MADV_POPULATE_WRITE) == 0:
            self.populated_bytes += length
            return
        code = ctypes.get_errno()
        if code == errno.EINVAL:   # a kernel before 5.14 does not know the advice
            self.supported = False
            log.info("kv cache: this kernel cannot populate memory ahead (MADV_POPULATE_WRITE); page faults stay "
                     "with the steps that write new blocks")
        else:                      # out of memory, say: the step that writes the block faults it in, as before
            log.debug("kv cache: populating %d bytes ahead failed: %s", length, errno.errorcode.get(code, code))
