"""The node's HTTP front's view of its engine process: starting it (`EngineProcess`) and an `EngineClient` over the
engine link (`RemoteEngine`).

Requests go out as `Submit`; the engine process validates them on its engine thread and answers `Rejected` (raised
at the stream's first output, as `EngineClient.generate` promises) or the request's outputs, one `Outputs` message
per engine step. A stream closed early sends `Abort`. If the engine process dies, every request in flight ends with
an EngineDeadError output, `/health` answers 503 and `dead` is set (the node then exits: server/node.py). The
engine process's heartbeats feed a watchdog (server/watchdog.py): silent or stalled, `/health` answers 503 too.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import subprocess
import sys
from collections.abc import AsyncGenerator
from multiprocessing.connection import Connection

from hybridpd.engine.request import EngineRequest, RequestOutput
from hybridpd.engine.request_streams import RequestStreams
from hybridpd.engine.tokenizer import Tokenizer
from hybridpd.errors import EngineDeadError
from hybridpd.named_thread import NamedThread
from hybridpd.server.args import NodeConfigs
from hybridpd.server.watchdog import EngineVerdict, Watchdog, WatchdogBounds
from hybridpd.server.engine_link import (
    Abort,
    Aborted,
    Drain,
    Drained,
    EngineFailed,
    EngineInfo,
    EngineStarted,
    Heartbeat,
    LinkEnd,
    MetricsText,
    Outputs,
    Rejected,
    ReleaseLease,
    ResetPrefixCache,
    ScrapeMetrics,
    StartFailed,
    Submit,
)

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 10.0
DRAIN_MARGIN_S = 30.0   # past the grace: the engine process's own stop (side channel, transport)
EXIT_TIMEOUT_S = 10.0


class EngineProcess:
    """The engine process of this node: `python -m hybridpd.server.engine_process` with one end of a socket pair."""

    def __init__(self, process: subprocess.Popen, link: LinkEnd) -> None:
        self.process = process
        self.link = link

    @classmethod
    def spawn(cls, configs: NodeConfigs) -> EngineProcess:
        """Start it from the calling (main) thread: the child's PR_SET_PDEATHSIG follows the thread that forked it."""
        front, engine = socket.socketpair()
        with engine:
            process = subprocess.Popen(
                [sys.executable, "-m", "hybridpd.server.engine_process", str(engine.fileno()), str(os.getpid())],
                pass_fds=(engine.fileno(),),
            )
        link = LinkEnd(Connection(front.detach()))
        link.send(configs)
        return cls(process, link)

    async def started(self) -> EngineStarted | StartFailed:
        try:
            message = await asyncio.to_thread(self.link.recv)
        except (EOFError, OSError):
            code = await asyncio.to_thread(self.process.wait)
            return StartFailed(f"the engine process exited with code {code} before it started",
                               bad_configuration=False)
        if not isinstance(message, (EngineStarted, StartFailed)):
            return StartFailed(f"the engine process answered {type(message).__name__} before it started",
                               bad_configuration=False)
        return message

    async def stop(self) -> int:
        """Its exit code, once it has exited. A process not yet drained (the front failed before its shutdown, e.g.
        its HTTP port was taken) is told to drain at once; one that has not exited within EXIT_TIMEOUT_S is killed."""
        if self.process.poll() is None:
            try:
                self.link.send(Drain(0.0))  # a second Drain after the front's own is ignored
            except OSError:
                pass
        try:
            return await asyncio.to_thread(self.process.wait, EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not exit: killing it")
            self.process.kill()
            return await asyncio.to_thread(self.process.wait)
        finally:
            self.link.close()


class RemoteEngine:
    """An `EngineClient` whose engine runs in the node's engine process."""

    def __init__(self, link: LinkEnd, info: EngineInfo, model_name: str, tokenizer: Tokenizer,
                 watchdog: WatchdogBounds = WatchdogBounds()) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.generation_defaults = info.generation_defaults
        self._link = link
        self._streams = RequestStreams()
        self._dead: str | None = None
        self._nonces = itertools.count()
        self._scrapes: dict[int, asyncio.Future[bytes]] = {}
        self._drained: asyncio.Future[int] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.watchdog = Watchdog(watchdog)
        self.dead = asyncio.Event()   # the engine process is gone (not by our own drain)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._streams.bind(self._loop)
        self._drained = self._loop.create_future()
        NamedThread(target=self._read, name="engine-link", daemon=True).start()

    def healthy(self) -> bool:
        return self.watchdog.verdict()[0] is EngineVerdict.ALIVE

    def health_detail(self) -> str:
        verdict, reason = self.watchdog.verdict()
        return "ok" if verdict is EngineVerdict.ALIVE else f"engine {verdict.value}: {reason}"

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead}")
        rid = request.request_id
        return self._streams.stream(rid, submit=lambda: self._send(Submit(request)), abort=lambda: self._abort(rid))

    def _abort(self, request_id: str) -> None:
        try:
            self._send(Abort(request_id))
        except EngineDeadError:
            pass  # nothing is left to abort

    def reset_prefix_cache(self) -> None:
        self._send(ResetPrefixCache())

    def release_lease(self, request_id: str, secret: str) -> None:
        self._send(ReleaseLease(request_id, secret))

    async def metrics_text(self) -> bytes:
        """The engine process's metric families (engine, connector, KV events), in Prometheus' text format."""
        assert self._loop is not None
        nonce = next(self._nonces)
        answer = self._scrapes[nonce] = self._loop.create_future()
        try:
            self._send(ScrapeMetrics(nonce))
            return await asyncio.wait_for(answer, SCRAPE_TIMEOUT_S)
        finally:
            self._scrapes.pop(nonce, None)

    async def drain(self, grace: float) -> int:
        """Stop the engine process (`Drain`): the number of leases it released at shutdown. Raises EngineDeadError
        when the engine process is gone (it released nothing)."""
        assert self._drained is not None
        self._stopping = True
        self._send(Drain(grace))
        return await asyncio.wait_for(self._drained, grace + DRAIN_MARGIN_S)

    def _send(self, message: object) -> None:
        try:
            self._link.send(message)
        except OSError as exc:  # the engine process is gone; the reader fails what is in flight
            raise EngineDeadError(f"the engine process is gone: {exc}") from exc

    # -- the link's reader thread -----------------------------------------------------------------------------------
    def _read(self) -> None:
        assert self._loop is not None
        try:
            while True:
                message = self._link.recv()
                if isinstance(message, Outputs):
                    self._streams.deliver(message.outputs)
                elif isinstance(message, Heartbeat):
                    self.watchdog.beat(message.steps, message.busy)
                elif isinstance(message, Rejected):
                    self._streams.rejected(message.request_id, message.error)
                elif isinstance(message, Aborted):
                    self._streams.aborted(message.request_id)
                elif isinstance(message, EngineFailed):
                    self._loop.call_soon_threadsafe(self._failed, message.reason)
                else:
                    self._loop.call_soon_threadsafe(self._answer, message)
        except (EOFError, OSError):
            try:
                self._loop.call_soon_threadsafe(self._failed, "the engine process exited")
            except RuntimeError:   # the front's loop has closed: it is on its way out anyway
                pass

    # -- event loop side ----------------------------------------------------------------------------------------------
    def _failed(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
            self.watchdog.dead(reason)
            if not self._stopping:
                log.error("engine failed: %s", reason)
                self.dead.set()
        self._streams.died(EngineDeadError(reason))
        for answer in self._scrapes.values():
            if not answer.done():
                answer.set_exception(EngineDeadError(reason))
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(EngineDeadError(reason))

    def _answer(self, message: object) -> None:
        if isinstance(message, MetricsText):
            answer = self._scrapes.get(message.nonce)
            if answer is not None and not answer.done():
                answer.set_result(message.text)
        elif isinstance(message, Drained):
            if self._drained is not None and not self._drained.done():
                self._drained.set_result(message.released)
        else:
            log.error("unexpected message on the engine link: %r", message)
