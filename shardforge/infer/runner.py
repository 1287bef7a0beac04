"""The engine on a thread of its own, for a server: requests from any thread or event loop go in, each
request's updates come out on its own asyncio queue. One lock guards the engine (a request is added between
two steps, never during one)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from shardforge.infer.engine import Engine, RequestError, Update
from shardforge.infer.sampling import SamplingParams


class QueueFull(RequestError):
    """More requests wait than the server takes: the client should retry later (HTTP 429)."""


@dataclass
class Timing:
    """When a request arrived, got its first token and its last (for the latency histograms)."""

    arrived: float = field(default_factory=time.perf_counter)
    first: float | None = None
    last: float | None = None
    tokens: int = 0


class EngineRunner:
    def __init__(self, engine: Engine, max_waiting: int = 256, on_finish=None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_finish = on_finish  # called as fn(timing, finish_reasons) when a request ends
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, Timing]] = {}
        self.stopping = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="shardforge-engine", daemon=True)
        self.thread.start()

    def submit(
        self, request_id: str, prompt: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop
    ) -> asyncio.Queue:
        """Queue a request (from a worker thread of `loop`); its updates arrive on the returned queue, None
        after the last. Raises RequestError / SamplingError for a bad one, QueueFull when full."""
        if self.error is not None:
            raise RuntimeError(f"the engine stopped on an error: {self.error!r}")
        queue: asyncio.Queue = asyncio.Queue()
        with self.lock:
            if len(self.engine.scheduler.waiting) >= self.max_waiting:
                raise QueueFull(f"{self.max_waiting} requests are waiting already; retry later")
            self.engine.add(request_id, prompt, params)
            self.queues[request_id] = (loop, queue, Timing())
        self.wake.set()
        return queue

    def abort(self, request_id: str) -> None:
        with self.lock:
            self.engine.abort(request_id)
            self.queues.pop(request_id, None)

    async def stream(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[Update]:
        """Submit and yield the request's updates; a consumer that stops early (a client gone) aborts it."""
        queue = await asyncio.to_thread(self.submit, request_id, prompt, params, asyncio.get_running_loop())
        finished = False
        try:
            while (update := await queue.get()) is not None:
                yield update
            finished = True
        finally:
            if not finished:
                await asyncio.to_thread(self.abort, request_id)

    def close(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=30)

    def _loop(self) -> None:
        while not self.stopping:
            with self.lock:
                busy = self.engine.has_work()
                if busy:
                    try:
                        updates = self.engine.step()
                    except BaseException as exc:  # a bug: fail every request rather than hang them
                        self.error = exc
                        self._fail_all()
                        raise
                    self._dispatch(updates)
            if not busy:
                self.wake.wait(timeout=0.5)
                self.wake.clear()

    def _dispatch(self, updates: list[Update]) -> None:
        now = time.perf_counter()
        for update in updates:
            entry = self.queues.get(update.request_id)
            if entry is None:
                continue
            loop, queue, timing = entry
            timing.first = timing.first or now
            timing.last, timing.tokens = now, timing.tokens + len(update.tokens)
            loop.call_soon_threadsafe(queue.put_nowait, update)
        for request_id in {
            u.request_id for u in updates
        }:  # after the whole step: n completions may end in it
            if request_id in self.queues and request_id not in self.engine.requests:
                loop, queue, timing = self.queues.pop(request_id)
                loop.call_soon_threadsafe(queue.put_nowait, None)
                if self.on_finish is not None:
                    self.on_finish(timing)

    def _fail_all(self) -> None:
        for loop, queue, _ in self.queues.values():
            loop.call_soon_threadsafe(queue.put_nowait, None)
        self.queues.clear()
