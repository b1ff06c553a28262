"""Engine clients: callers on an asyncio event loop stream the events of their requests from an `LLMEngine`.

Two clients with one interface (`generate`, `stats`, `alive`, `shutdown`):
- `AsyncEngine` steps the engine on a worker thread of this process.
- `ProcessEngine` (engine_process.py) steps it in a child process, so the model's Python never competes with
  the event loop for this process's GIL (what a serving replica uses).

Either way the event loop only enqueues requests and reads events. Events are handed to the loop with one
`call_soon_threadsafe` per batch of events (the first tokens of new prompts leave before the step's decode
pass). Leaving the `generate` iterator early (client disconnect, cancellation, timeout) aborts the request,
and its cache rows are freed at the engine's next step.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, AsyncIterator

from .protocol import EngineError, EngineStats, SamplingParams, TokenEvent

if TYPE_CHECKING:          # the engine's own process imports it; a replica that only talks to it needs no torch
    from .engine import LLMEngine

logger = logging.getLogger(__name__)

STATS_PERIOD_S = 0.5   # how often a busy engine reports its EngineStats (on_stats)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class EngineClient(ABC):
    """An engine's client: per-request queues on the callers' event loops, fed from another thread. Subclasses
    say how a request reaches the engine (`_submit`) and how it is stopped (`_cancel`). `on_stats(stats)`, when
    given, is called with each fresh EngineStats (on the thread that has them)."""

    max_rows: int

    def __init__(self, on_stats=None) -> None:
        self.on_stats = on_stats
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}

    @abstractmethod
    def _submit(self, prompt: list[int], params: SamplingParams, rid: str, resume: list[int] | None) -> None:
        """Hand the request to the engine (raising if it refuses at once)."""

    @abstractmethod
    def _cancel(self, rid: str) -> None:
        """Abort the request in the engine; its rows are freed at the next step."""

    def _deliver(self, events: list[TokenEvent]) -> None:
        self._route([(ev.request_id, ev) for ev in events])

    def _fail(self, rids: list[str], error: BaseException) -> None:
        """End these requests with `error`, raised from their `generate`."""
        self._route([(rid, error) for rid in rids])

    def _route(self, items: list[tuple[str, object]]) -> None:
        """Hand (request id, event or exception) pairs to their requests' loops: one wake-up per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for rid, item in items:
            target = self._queues.get(rid)
            if target is not None:
                loop, queue = target
                by_loop.setdefault(loop, []).append((queue, item))
        for loop, pairs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, pairs)
            except RuntimeError:   # that loop has closed: its callers are gone
                pass

    @abstractmethod
    def stats(self) -> EngineStats:
        """The engine's latest counters."""

    @abstractmethod
    def alive(self) -> bool:
        """Whether the engine still steps."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the engine."""

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                       resume: list[int] | None = None) -> AsyncIterator[list[TokenEvent]]:
        """Stream the events of one request until each of its samples has finished. Each item is every event
        that was ready at that moment (one or more): under load, callers pass tokens on in fewer, larger
        messages instead of paying a hop per token. A request the engine refuses raises its error (EngineError,
        EngineFull) from the first iteration. resume: continue an earlier run (LLMEngine.add_request)."""
        queue: asyncio.Queue = asyncio.Queue()
        rid = request_id or f"req-{uuid.uuid4().hex}"
        if rid in self._queues:
            raise EngineError(f"request id {rid!r} is already in use")
        self._queues[rid] = (asyncio.get_running_loop(), queue)   # before the engine can emit anything for it
        try:
            self._submit(prompt, params, rid, resume)
        except Exception:
            self._queues.pop(rid, None)
            raise
        remaining = params.n
        try:
            while remaining:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                for item in batch:
                    if isinstance(item, BaseException):
                        remaining = 0          # refused or lost: there is nothing to abort
                        raise item
                remaining -= sum(1 for ev in batch if ev.finish_reason is not None)
                yield batch
        finally:
            self._queues.pop(rid, None)
            if remaining:
                self._cancel(rid)


class AsyncEngine(EngineClient):
    """The engine on a worker thread of this process (tests, benchmarks, notebooks). `on_stats` is called on
    that thread after each step."""

    def __init__(self, engine: LLMEngine, on_stats=None):
        super().__init__(on_stats)
        self.engine = engine
        self.max_rows = engine.max_rows
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="chat-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        stats_at = 0.0
        while not self._stopping:
            if not self.engine.has_work():
                if stats_at:                    # the last word after a busy spell: idle stats
                    self._report()
                    stats_at = 0.0
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                events = self.engine.step(emit=self._deliver)
            except Exception:   # a fault in the model must not kill the thread or leave callers hanging
                logger.exception("engine step failed; ending every request")
                events = self.engine.fail_all("error")
            self._deliver(events)
            now = time.monotonic()
            if now - stats_at >= STATS_PERIOD_S:
                self._report()
                stats_at = now

    def _report(self) -> None:
        if self.on_stats is not None:
            self.on_stats(self.engine.stats())

    def _submit(self, prompt: list[int], params: SamplingParams, rid: str, resume: list[int] | None) -> None:
        self.engine.add_request(prompt, params, rid, resume)
        self._wake.set()

    def _cancel(self, rid: str) -> None:
        self.engine.abort(rid)
        self._wake.set()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)
