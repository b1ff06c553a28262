"""An asyncio front for `LLMEngine`: the model steps on a worker thread, events come back per request.

The event loop only enqueues requests and reads events; every forward pass runs on the engine thread,
which sleeps when there is no work. Events are handed to the loop with one `call_soon_threadsafe` per
step (and one more for the first tokens, which leave before the step's decode pass). Leaving
the `generate` iterator early (client disconnect, cancellation, timeout) aborts the request, and its
cache rows are freed at the engine's next step.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from typing import AsyncIterator

from .engine import LLMEngine, TokenEvent
from .sampler import SamplingParams

logger = logging.getLogger(__name__)


def _put_all(items: list[tuple[asyncio.Queue, TokenEvent]]) -> None:
    for queue, ev in items:
        queue.put_nowait(ev)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step=None):
        self.engine = engine
        self.on_step = on_step               # called on the engine thread after each step (metrics)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="chat-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping:
            if not self.engine.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                events = self.engine.step(emit=self._deliver)
            except Exception:   # a fault in the model must not kill the thread or leave callers hanging
                logger.exception("engine step failed; ending every request")
                events = self.engine.fail_all("error")
            self._deliver(events)
            if self.on_step is not None:
                self.on_step(self.engine, events)

    def _deliver(self, events: list[TokenEvent]) -> None:
        """Hand events to their requests' loops: one wake-up per loop, not one per event."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for ev in events:
            target = self._queues.get(ev.request_id)
            if target is not None:
                loop, queue = target
                by_loop.setdefault(loop, []).append((queue, ev))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:   # that loop has closed: its callers are gone
                pass

    async def generate(self, prompt: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[list[TokenEvent]]:
        """Stream the events of one request until each of its samples has finished. Each item is every event
        that was ready at that moment (one or more): under load, callers pass tokens on in fewer, larger
        messages instead of paying a hop per token."""
        queue: asyncio.Queue = asyncio.Queue()
        rid = request_id or f"req-{uuid.uuid4().hex}"
        self._queues[rid] = (asyncio.get_running_loop(), queue)   # before the engine can emit anything for it
        try:
            self.engine.add_request(prompt, params, rid)
        except Exception:
            self._queues.pop(rid, None)
            raise
        self._wake.set()
        remaining = params.n
        try:
            while remaining:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                remaining -= sum(1 for ev in batch if ev.finish_reason is not None)
                yield batch
        finally:
            self._queues.pop(rid, None)
            if remaining:
                self.engine.abort(rid)
                self._wake.set()

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)
