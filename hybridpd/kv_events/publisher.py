"""The node's KV event publisher: a ZMQ PUB socket and a replay ROUTER socket, served by one thread.

The engine thread only calls `publish`, which puts the step's events on a bounded queue and returns; when the
queue is full the batch is dropped and counted (the engine never waits). The publisher thread encodes each batch,
numbers it (0, 1, 2, ... from the node's start), sends `(topic, seq, payload)` on PUB (ZMQ drops for a subscriber
past the high-water mark) and keeps the last `buffer_steps` for replay. A replay request is
`(identity, b"", seq)` on the ROUTER; the answer is every buffered `(b"", seq, payload)` from that number on, then
`(b"", -1, b"")`.

The thread sleeps until there is something to do: it polls the replay socket and a pipe the engine thread writes a
byte to after each batch it queues (a timed poll would wake every node's engine process dozens of times a second
while it idles).
"""

from __future__ import annotations

import logging
import os
import queue
import time
from collections import deque
from collections.abc import Sequence

import zmq

from hybridpd.engine.kv_cache.events import KVCacheEvent
from hybridpd.kv_events.config import KVEventsConfig, binds, listen_endpoint
from hybridpd.kv_events.wire import END_OF_REPLAY, GroupInfo, encode_batch, seq_bytes, seq_of
from hybridpd.named_thread import NamedThread

log = logging.getLogger(__name__)

_STOP = None


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, groups: Sequence[GroupInfo], host: str = "0.0.0.0") -> None:
        """`host`: the node's `--host`, where wildcard endpoints are bound (kv_events/config.py: listen_endpoint)."""
        self._config = config
        self._groups = tuple(groups)
        self._queue: queue.Queue[tuple[float, list[KVCacheEvent]] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(config.hwm)
            if binds(config.endpoint):
                self._pub.bind(listen_endpoint(config.endpoint, host))
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(listen_endpoint(config.replay_endpoint, host))
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"KV events: cannot open {config.endpoint} / {config.replay_endpoint}: {exc}") from exc
        self.published = 0
        self.dropped = 0
        self._wake_read, self._wake_write = os.pipe()   # a byte after each queued batch: the thread's wake-up
        os.set_blocking(self._wake_write, False)
        self._thread = NamedThread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # -- engine thread ------------------------------------------------------------------------------------------
    def publish(self, events: list[KVCacheEvent]) -> None:
        """Non-blocking: a full queue drops this batch (counted in `dropped`)."""
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1
            return
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"\0")
        except BlockingIOError:   # the pipe is full of wake-ups already: the thread will drain the queue
            pass

    # -- publisher thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_read, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        seq = 0
        while True:
            ready = dict(poller.poll())
            if self._replay is not None and self._replay in ready:
                while self._replay.poll(0):
                    self._serve_replay()
            if self._wake_read not in ready:
                continue
            os.read(self._wake_read, 4096)   # the byte(s) come after their batches: the queue holds them now
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    return
                if self._send(seq, *item):
                    seq += 1

    def _send(self, seq: int, ts: float, events: list[KVCacheEvent]) -> bool:
        """Publish one batch as number `seq`; False if it could not be (its number goes to the next batch)."""
        try:
            payload = encode_batch(events, self._groups, ts)
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload))
        except Exception:  # noqa: BLE001 - a broken batch must not stop the publisher
            log.exception("KV events: could not publish batch %d", seq)
            return False
        self._buffer.append((seq, payload))
        self.published += 1
        return True

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: ignoring a malformed replay request (%d frames)", len(frames))
            return
        identity, start = frames[0], seq_of(frames[2])
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((identity, b"", seq_bytes(seq), payload))
        self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""))

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to `timeout`), then close the sockets."""
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        self._wake()
        self._thread.join(timeout)
        self._close_sockets()
        if not self._thread.is_alive():
            os.close(self._wake_read)
            os.close(self._wake_write)

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
