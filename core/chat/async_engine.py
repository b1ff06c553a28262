"""Engine clients: callers on an asyncio event loop stream the events of their requests from an `LLMEngine`.

Two clients with one interface (`generate`, `stats`, `alive`, `shutdown`):
- `ThreadEngine` steps the engine on a worker thread of this process.
- `ProcessEngine` (engine_process.py) steps it in a child process, so the model's Python never competes with
  the event loop for this process's GIL (what a serving replica uses).

Either way the event loop only enqueues requests and reads events. The thread that receives a step's events
sorts them by request and hands each stream its share with one `call_soon_threadsafe` per loop; a stream's
reader wakes once for whatever is ready (the first tokens of new prompts leave before the step's decode
pass), and `StreamHold` can hold a stream's tokens for a few steps so that the hops after it carry fewer,
larger messages. Leaving the `generate` iterator early (client disconnect, cancellation, timeout) aborts the
request, and its cache rows are freed at the engine's next step.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

from .protocol import EngineError, EngineStats, SamplingParams, TokenEvent

if TYPE_CHECKING:          # the engine's own process imports it; a replica that only talks to it needs no torch
    from .engine import LLMEngine

logger = logging.getLogger(__name__)

STATS_PERIOD_S = 0.5   # how often a busy engine reports its EngineStats (on_stats)


@dataclass(frozen=True)
class StreamHold:
    """When the engine client wakes a stream's reader with what the engine sent it. Until the stream has shown
    output (text, or the end of a calculator part), every step's events go at once, and so does a sample's end
    or a failure; after that, the events are held until `tokens` tokens are held, or, with `seconds`, until
    that long has passed since the stream's last wake (checked as each step's events arrive: nothing is held
    past the stream's next step once it is due). The defaults hold nothing. A reader that is slower than its
    stream's steps gets everything that arrived meanwhile in one wake, held or not."""

    tokens: int = 1
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.seconds < 0:
            raise ValueError("a stream hold takes tokens >= 1 and seconds >= 0")


class _Stream:
    """One request's events between the thread that receives them and the loop that reads them. `held` and
    its counters belong to the receiving thread, `ready` and `waiter` to the loop."""

    __slots__ = ("loop", "held", "held_tokens", "shown", "woken_at", "ready", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.held: list = []
        self.held_tokens = 0
        self.shown = False
        self.woken_at = 0.0
        self.ready: list = []
        self.waiter: asyncio.Future | None = None


def _wake(handoffs: list[tuple[_Stream, list]]) -> None:
    """On a stream's loop: the handed-over events become ready and the stream's reader wakes."""
    for stream, items in handoffs:
        stream.ready += items
        waiter = stream.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class EngineClient(ABC):
    """An engine's client: per-request streams on the callers' event loops, fed from another thread with one
    wake per stream per step at most, fewer as `hold` says. Subclasses say how a request reaches the engine
    (`_submit`) and how it is stopped (`_cancel`). `on_stats(stats)`, when given, is called with each fresh
    EngineStats (on the thread that has them)."""

    max_rows: int

    def __init__(self, on_stats=None, hold: StreamHold | None = None) -> None:
        self.on_stats = on_stats
        self.hold = hold or StreamHold()
        self.clock = time.monotonic
        self._queues: dict[str, _Stream] = {}

    @abstractmethod
    def _submit(self, prompt: list[int], params: SamplingParams, rid: str, resume: list[int] | None) -> None:
        """Hand the request to the engine (raising if it refuses at once)."""

    @abstractmethod
    def _cancel(self, rid: str) -> None:
        """Abort the request in the engine; its rows are freed at the next step."""

    def _deliver(self, events: list[TokenEvent]) -> None:
        """One step's events (on the receiving thread): each stream's go to its held list, and the streams whose
        hold is over are handed theirs, with one call per loop."""
        streams = self._queues
        touched: dict[str, _Stream] = {}
        for ev in events:
            stream = streams.get(ev.request_id)
            if stream is None:                      # a request that has gone (its reader left)
                continue
            stream.held.append(ev)
            if ev.token is not None:
                stream.held_tokens += 1
            if not stream.shown and ev.shows_output:
                stream.shown = True                 # the first output goes at once
                stream.woken_at = 0.0
            elif ev.finish_reason is not None:
                stream.woken_at = 0.0               # and so does a sample's end
            touched[ev.request_id] = stream
        if not touched:
            return
        hold, now = self.hold, self.clock()
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream in touched.values():
            if (stream.woken_at and stream.held_tokens < hold.tokens
                    and not (hold.seconds and now - stream.woken_at >= hold.seconds)):
                continue
            by_loop.setdefault(stream.loop, []).append((stream, stream.held))
            stream.held, stream.held_tokens = [], 0
            stream.woken_at = now if stream.shown else 0.0
        self._hand_over(by_loop)

    def _fail(self, rids: list[str], error: BaseException) -> None:
        """End these requests with `error`, raised from their `generate` after the events held for them."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for rid in rids:
            stream = self._queues.get(rid)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, stream.held + [error]))
                stream.held = []
        self._hand_over(by_loop)

    @staticmethod
    def _hand_over(by_loop: dict) -> None:
        for loop, handoffs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_wake, handoffs)
            except RuntimeError:   # that loop has closed: its callers are gone
                pass

    @abstractmethod
    def stats(self) -> EngineStats:
        """The engine's latest counters."""

    @property
    @abstractmethod
    def linear(self) -> str:
        """How the engine's model runs its linear layers (LLMEngine.linear)."""

    @property
    @abstractmethod
    def attention(self) -> str:
        """How the engine's model runs decode attention (LLMEngine.attention)."""

    @property
    @abstractmethod
    def dtype(self) -> str:
        """The engine's model's precision (LLMEngine.dtype)."""

    @property
    @abstractmethod
    def decode(self) -> str:
        """How a decode pass of a few rows runs the model's blocks (LLMEngine.decode)."""

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
        rid = request_id or f"req-{uuid.uuid4().hex}"
        if rid in self._queues:
            raise EngineError(f"request id {rid!r} is already in use")
        loop = asyncio.get_running_loop()
        stream = self._queues[rid] = _Stream(loop)   # before the engine can emit anything for it
        try:
            self._submit(prompt, params, rid, resume)
        except Exception:
            self._queues.pop(rid, None)
            raise
        remaining = params.n
        try:
            while remaining:
                while not stream.ready:
                    stream.waiter = loop.create_future()
                    try:
                        await stream.waiter
                    finally:
                        stream.waiter = None
                batch, stream.ready = stream.ready, []
                for k, item in enumerate(batch):
                    if isinstance(item, BaseException):
                        remaining = 0          # refused or lost: there is nothing to abort
                        if k:
                            yield batch[:k]    # what arrived before the failure still goes out
                        raise item
                remaining -= sum(1 for ev in batch if ev.finish_reason is not None)
                yield batch
        finally:
            self._queues.pop(rid, None)
            if remaining:
                self._cancel(rid)


class ThreadEngine(EngineClient):
    """The engine on a worker thread of this process (tests, benchmarks, notebooks). `on_stats` is called on
    that thread after each step."""

    def __init__(self, engine: LLMEngine, on_stats=None, hold: StreamHold | None = None):
        super().__init__(on_stats, hold)
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

    @property
    def linear(self) -> str:
        return self.engine.linear

    @property
    def attention(self) -> str:
        return self.engine.attention

    @property
    def dtype(self) -> str:
        return self.engine.dtype

    @property
    def decode(self) -> str:
        return self.engine.decode

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)
