"""The engine on its own thread, driven from asyncio.

Everything that touches the engine runs on the engine thread: callers post callables to an inbox, and what the engine
produces goes to an `OutputSink` (`hybridpd.engine.request_streams`): by default this process's own request
streams, in the node's engine process the pipe to the HTTP front. The thread blocks on the inbox when there is no
work, so an idle node uses no CPU; torch releases the GIL while it computes.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable

from hybridpd.engine.cpu_set import pin_current_thread
from hybridpd.engine.engine import LLMEngine
from hybridpd.engine.kv_cache.events import KVCacheEvent
from hybridpd.engine.request import EngineRequest, FinishReason, RequestOutput
from hybridpd.engine.request_streams import OutputSink, RequestStreams
from hybridpd.errors import EngineDeadError, ServerOverloadedError
from hybridpd.named_thread import NamedThread

log = logging.getLogger(__name__)

_STOP = object()

# Hears the KV cache events of each engine-thread iteration; must not block (the node's publisher only enqueues).
KVEventSink = Callable[[list[KVCacheEvent]], None]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, model_name: str, kv_event_sink: KVEventSink | None = None,
                 sink: OutputSink | None = None) -> None:
        self.engine = engine
        self._kv_event_sink = kv_event_sink
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.generation_defaults = engine.generation_defaults
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams = RequestStreams()  # this process's own consumers (`generate`)
        self._sink: OutputSink = sink if sink is not None else self._streams
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._admitting = True
        # Progress, written by the engine thread and read by the node's watchdog (server/engine_process.py): steps
        # taken, and whether work was held when the thread last looked (a thread stuck inside a step stays busy).
        self.steps = 0
        self._busy = False

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._streams.bind(asyncio.get_running_loop())
        self._thread = NamedThread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def shutdown(self, grace: float) -> None:
        """Stop admitting; let running requests finish within `grace` seconds, then abort the rest."""
        self._admitting = False
        deadline = asyncio.get_running_loop().time() + grace
        while self._streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        self.call_soon(self._abort_all)
        self._inbox.put(_STOP)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        await asyncio.to_thread(self.engine.close)

    def healthy(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    def health_detail(self) -> str:
        return "ok" if self.healthy() else f"the engine thread is not running: {self._dead}"

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    @property
    def busy(self) -> bool:
        """Whether work waits for the engine thread: requests it holds, or calls not yet taken from its inbox."""
        return self._busy or not self._inbox.empty()

    # -- the API the server uses --------------------------------------------------------------------------------
    def generate(self, request: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs (EngineClient.generate); bad input is refused here, before anything is queued."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead}")
        if not self._admitting:
            raise ServerOverloadedError("the node is shutting down")
        self.engine.validate(request)
        rid = request.request_id
        return self._streams.stream(rid, submit=lambda: self.call_soon(lambda: self._add(request)),
                                    abort=lambda: self.abort(rid))

    def submit(self, request: EngineRequest) -> None:
        """Add `request` from another process: validated on the engine thread, a refusal goes to the sink."""
        self.call_soon(lambda: self._add(request, validate=True))

    def abort(self, request_id: str) -> None:
        """Drop `request_id` (its consumer left); the sink hears `aborted` once the engine has."""
        self.call_soon(lambda: self._abort(request_id))

    def call_soon(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the engine thread between two steps; a RequestOutput it returns goes to its request."""
        self._inbox.put(fn)

    # -- engine thread ------------------------------------------------------------------------------------------
    def _add(self, request: EngineRequest, validate: bool = False) -> RequestOutput | None:
        """Queue `request`; returns its first output when it has one at once (a remotely prefilled request's first
        token), which `_run` delivers before the next step."""
        if validate:
            try:
                self.engine.validate(request)
            except Exception as exc:  # the request's own bad input: the consumer raises it
                self._sink.rejected(request.request_id, exc)
                return None
        try:
            return self.engine.add_request(request)
        except Exception as exc:  # validated already; a failure here is the request's own
            self._sink.deliver([
                RequestOutput(request_id=request.request_id, new_token_ids=(), new_text="", num_prompt_tokens=0,
                              num_cached_tokens=0, num_output_tokens=0, finished=True,
                              finish_reason=FinishReason.ERROR, error=exc)
            ])
            return None

    def _abort(self, request_id: str) -> None:
        """Abort a request whose consumer left; its last output is for nobody."""
        self.engine.abort(request_id)
        self._sink.aborted(request_id)

    def _abort_all(self) -> None:
        """Shutdown: every request still held ends with an ABORT output its consumer receives."""
        outputs = [self.engine.abort(request_id) for request_id in self.engine.request_ids()]
        self._sink.deliver([out for out in outputs if out is not None])

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
                        self._sink.deliver([result])
                    item = self._poll_inbox()
                self._busy = self.engine.has_work()
                if self._busy:
                    outputs = self.engine.step()
                    self.steps += 1
                    if outputs:
                        self._sink.deliver(outputs)
                self.engine.refresh_stats()
                if self._kv_event_sink is not None:
                    events = self.engine.kv.take_events() + self.engine.storage_events()
                    if events:
                        self._kv_event_sink(events)
        except BaseException as exc:  # the engine is broken: fail everyone, report unhealthy
            log.exception("engine thread died")
            self._dead = exc
            self._sink.died(exc)

    def _poll_inbox(self):
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None
