"""The engine on its own thread, driven from asyncio.

Everything that touches the engine runs on the engine thread: the asyncio side posts callables to an inbox, and
outputs come back with `loop.call_soon_threadsafe`. The thread blocks on the inbox when there is no work, so an
idle node uses no CPU; torch releases the GIL while it computes, so the event loop stays responsive.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

from hybridpd.engine.cpu_set import pin_current_thread
from hybridpd.engine.engine import LLMEngine
from hybridpd.engine.kv_cache.events import KVCacheEvent
from hybridpd.engine.request import EngineRequest, FinishReason, RequestOutput
from hybridpd.errors import EngineDeadError, ServerOverloadedError

log = logging.getLogger(__name__)

_STOP = object()

# Hears the KV cache events of each engine-thread iteration; must not block (the node's publisher only enqueues).
KVEventSink = Callable[[list[KVCacheEvent]], None]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, model_name: str, kv_event_sink: KVEventSink | None = None) -> None:
        self.engine = engine
        self._kv_event_sink = kv_event_sink
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.generation_defaults = engine.generation_defaults
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        # Ids whose consumer left before the end: busy until the engine thread has aborted them, so that a new
        # request with the same id never receives the old one's outputs.
        self._closing: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._admitting = True

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def shutdown(self, grace: float) -> None:
        """Stop admitting; let running requests finish within `grace` seconds, then abort the rest."""
        self._admitting = False
        deadline = asyncio.get_running_loop().time() + grace
        while self._queues and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self._queues):
            self.call_soon(lambda rid=request_id: self.engine.abort(rid))
        self._inbox.put(_STOP)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def healthy(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_active_requests(self) -> int:
        return len(self._queues)

    # -- the API the server uses --------------------------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead}")
        if not self._admitting:
            raise ServerOverloadedError("the node is shutting down")
        self.engine.validate(request)
        rid = request.request_id
        if rid in self._queues or rid in self._closing:
            raise ServerOverloadedError(f"request id {rid} is already in flight")
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[rid] = outputs
        self.call_soon(lambda: self._add(request))
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self._closing.add(rid)
                self.call_soon(lambda: self._abort_abandoned(rid))

    def call_soon(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the engine thread between two steps; a RequestOutput it returns goes to its request."""
        self._inbox.put(fn)

    # -- engine thread ------------------------------------------------------------------------------------------
    def _add(self, request: EngineRequest) -> RequestOutput | None:
        """Queue `request`; returns its first output when it has one at once (a remotely prefilled request's first
        token), which `_run` delivers before the next step."""
        try:
            return self.engine.add_request(request)
        except Exception as exc:  # validated already; a failure here is the request's own
            self._deliver([
                RequestOutput(request_id=request.request_id, new_token_ids=(), new_text="", num_prompt_tokens=0,
                              num_cached_tokens=0, num_output_tokens=0, finished=True,
                              finish_reason=FinishReason.ERROR, error=exc)
            ])
            return None

    def _abort_abandoned(self, request_id: str) -> None:
        """Abort a request whose consumer left; its last output is for nobody. Outputs reach the loop in the order
        they were sent, so once `_closing` forgets the id no output of the old request is still on its way."""
        self.engine.abort(request_id)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._closing.discard, request_id)

    def _run(self) -> None:
        cpus = self.engine.config.cpus
        if cpus is not None:
            pin_current_thread(cpus)
        try:
            while True:
                item = self._inbox.get() if not self.engine.has_work() else self._poll_inbox()
                while item is not None:
                    if item is _STOP:
                        return
                    result = item()
                    if isinstance(result, RequestOutput):
                        self._deliver([result])
                    item = self._poll_inbox()
                if self.engine.has_work():
                    self._deliver(self.engine.step())
                self.engine.refresh_stats()
                if self._kv_event_sink is not None:
                    events = self.engine.kv.take_events()
                    if events:
                        self._kv_event_sink(events)
        except BaseException as exc:  # the engine is broken: fail everyone, report unhealthy
            log.exception("engine thread died")
            self._dead = exc
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._fail_all, exc)

    def _poll_inbox(self):
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._put_all, outputs)

    # -- event loop side ----------------------------------------------------------------------------------------
    def _put_all(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _fail_all(self, exc: BaseException) -> None:
        for rid, q in self._queues.items():
            q.put_nowait(
                RequestOutput(request_id=rid, new_token_ids=(), new_text="", num_prompt_tokens=0, num_cached_tokens=0,
                              num_output_tokens=0, finished=True, finish_reason=FinishReason.ERROR,
                              error=EngineDeadError(f"the engine stopped: {exc}"))
            )
