"""The engine on a thread of its own, for a server, and its output processing on another. New requests and
aborts reach the engine through an inbox it drains between two steps, so neither waits for a step to end.
Each step's token updates go, in order, to the output thread, which detokenizes them (output.py: text, stop
strings; a stop string's completion is finished through the inbox) while the engine runs the next step,
and puts each request's updates on its own asyncio queue. The engine thread publishes an `EngineStats`
snapshot after every step for the metrics to read."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardforge.infer.engine import Engine
from shardforge.infer.engine_types import RequestError, Update
from shardforge.infer.output import OutputProcessor
from shardforge.infer.sampling import SamplingParams
from shardforge.models.common.images import ImageInputs

log = logging.getLogger(__name__)


class QueueFull(RequestError):
    """More requests wait than the server takes: the client should retry later (HTTP 429)."""


class Unavailable(RequestError):
    """The engine stopped on an error, or the server is shutting down (HTTP 503)."""


@dataclass
class Timing:
    """When a request arrived and when each of its tokens came (for the latency histograms)."""

    arrived: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # seconds between successive updates
    reason: str = "finished"  # finished | aborted | failed


@dataclass(eq=False)
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    timing: Timing


class RequestStream:
    """One request's updates, as an async iterator. `close()` is synchronous, so that it runs even in a task
    being cancelled (a client gone): it aborts the request unless the request has ended."""

    def __init__(self, runner: EngineRunner, request_id: str, updates: asyncio.Queue) -> None:
        self.runner, self.request_id, self.updates = runner, request_id, updates
        self.ended = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Update:
        if self.ended:
            raise StopAsyncIteration
        update = await self.updates.get()
        if update is None:
            self.ended = True
            raise StopAsyncIteration
        return update

    def close(self) -> None:
        if not self.ended:
            self.ended = True
            self.runner.abort(self.request_id)


class EngineRunner:
    def __init__(
        self,
        engine: Engine,
        max_waiting: int = 256,
        on_finish: Callable[[Timing], None] | None = None,
    ) -> None:
        self.engine = engine
        engine.detokenize = False  # the output thread does it
        self.output = OutputProcessor(engine.tokenizer)
        self.max_waiting = max_waiting
        self.on_finish = on_finish  # called with the request's Timing when it ends
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # engine thread -> output thread, in order
        self.wake = threading.Event()
        self.sinks: dict[str, _Sink] = {}  # the output thread's alone
        self.count_lock = threading.Lock()
        self.pending: set[str] = set()  # submitted, no token yet: the queue that 429 bounds
        self.stats = engine.stats()
        self.stopping = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="shardforge-engine", daemon=True)
        self.output_thread = threading.Thread(target=self._outputs, name="shardforge-output", daemon=True)
        self.output_thread.start()
        self.thread.start()

    # ---- any thread -------------------------------------------------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        loop: asyncio.AbstractEventLoop,
        images: ImageInputs | None = None,
        adapter: str | None = None,
    ) -> RequestStream:
        """Queue a request; its updates arrive on the returned stream. Raises RequestError / SamplingError
        for a bad one (checked here, before it is queued), QueueFull when the queue is full."""
        if self.error is not None:
            raise Unavailable(f"the engine stopped on an error: {self.error!r}", None)
        if self.stopping:
            raise Unavailable("the server is shutting down", None)
        params = self.engine.check(prompt, params)
        with self.count_lock:
            if len(self.pending) >= self.max_waiting:
                raise QueueFull(f"{self.max_waiting} requests are waiting already; retry later", None)
            self.pending.add(request_id)
        updates: asyncio.Queue = asyncio.Queue()
        self.inbox.put(("add", request_id, prompt, params, images, _Sink(loop, updates, Timing()), adapter))
        self.wake.set()
        return RequestStream(self, request_id, updates)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the engine's thread between two steps (loading a LoRA adapter into the layers the
        step reads); its result or error comes back on the future."""
        if self.error is not None or self.stopping:
            raise Unavailable("the engine is not running", None)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put(("call", fn, future))
        self.wake.set()
        return future

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks, between this step and the next. Never blocks."""
        self.inbox.put(("abort", request_id))
        self.wake.set()

    @property
    def waiting(self) -> int:
        return len(self.pending)

    def close(self) -> None:
        """Abort what is in flight and stop the threads."""
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=30)
        self.output_thread.join(timeout=30)

    # ---- the engine thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self.stopping:
                self._drain()
                if self.engine.has_work():
                    updates = self.engine.step()
                    self.outbox.put(("updates", updates, time.perf_counter()))
                    self.stats = self.engine.stats()
                else:
                    self.stats = self.engine.stats()
                    self.wake.wait(timeout=0.5)
                    self.wake.clear()
            self._drain()
            for request_id in list(self.engine.requests):
                self.engine.abort(request_id)
            self.outbox.put(("stop", "aborted"))
        except BaseException as exc:  # a bug: fail every request rather than hang them
            self.error = exc
            log.exception("the engine stopped on an error: %r", exc)
            self.outbox.put(("stop", "failed"))

    def _drain(self) -> None:
        """Apply the queued adds, aborts and stop-string finishes (an abort of a request not yet added
        cancels the add)."""
        while True:
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return
            kind = message[0]
            if kind == "add":
                _, request_id, prompt, params, images, sink, adapter = message
                try:
                    params = self.engine.add(request_id, prompt, params, images, adapter)
                except RequestError as exc:  # checked in submit: a duplicate id, an adapter unloaded since
                    log.warning("request %s refused: %s", request_id, exc)
                    self.outbox.put(("start", request_id, params, sink))
                    self.outbox.put(("end", request_id, "failed"))
                    continue
                self.outbox.put(("start", request_id, params, sink))
            elif kind == "call":
                _, fn, future = message
                try:
                    future.set_result(fn())
                except Exception as exc:  # the caller's to report (a bad adapter folder: a 400)
                    future.set_exception(exc)
            elif kind == "abort":
                self.engine.abort(message[1])
                self.outbox.put(("end", message[1], "aborted"))
            else:  # "finish": a stop string ended one completion
                self.engine.finish(message[1], message[2])

    # ---- the output thread ------------------------------------------------------------------------------
    def _outputs(self) -> None:
        """Messages from the engine thread, in its order: a request started, a step's updates, a request
        ended by an abort, stop. A bug here fails every request and stops the engine rather than hang."""
        try:
            while True:
                message = self.outbox.get()
                kind = message[0]
                if kind == "start":
                    _, request_id, params, sink = message
                    self.sinks[request_id] = sink
                    self.output.start(request_id, params)
                elif kind == "updates":
                    self._dispatch(message[1], message[2])
                elif kind == "end":
                    self.output.drop(message[1])
                    self._end(message[1], message[2])
                else:  # "stop": whatever is still open ends
                    for request_id in list(self.sinks):
                        self._end(request_id, message[1])
                    return
        except BaseException as exc:
            self.error = exc
            log.exception("the output thread stopped on an error: %r", exc)
            self.stopping = True
            self.wake.set()
            for request_id in list(self.sinks):
                self._end(request_id, "failed")

    def _end(self, request_id: str, reason: str) -> None:
        with self.count_lock:
            self.pending.discard(request_id)
        sink = self.sinks.pop(request_id, None)
        if sink is None:
            return
        sink.timing.reason = reason
        try:
            if self.on_finish is not None:  # counted before its client hears of the end: /metrics agrees
                self.on_finish(sink.timing)
        finally:
            with contextlib.suppress(RuntimeError):  # its event loop has closed (the server stopped)
                sink.loop.call_soon_threadsafe(sink.queue.put_nowait, None)

    def _dispatch(self, updates: list[Update], now: float) -> None:
        processed = self.output.process(updates)
        for request_id, index in processed.stopped:
            self.inbox.put(("finish", request_id, index))
        started = []
        for update in processed.updates:
            sink = self.sinks.get(update.request_id)
            if sink is None:
                continue
            timing = sink.timing
            if timing.first is None:
                timing.first = now
                started.append(update.request_id)
            elif timing.last is not None:
                timing.gaps.append(now - timing.last)
            timing.last, timing.tokens = now, timing.tokens + len(update.tokens)
            with contextlib.suppress(RuntimeError):
                sink.loop.call_soon_threadsafe(sink.queue.put_nowait, update)
        with self.count_lock:
            self.pending.difference_update(started)
        for request_id in processed.done:  # after the whole batch: n completions may end in one step
            self._end(request_id, "finished")
