"""Chat admission in the Ingress: how many generations go to a chat model's deployment at once, and who waits.

The Ingress keeps one Admission per chat model. At most `limit` generations of a model are in flight from one
Ingress replica, `waiting` more wait for a slot here, and
anything beyond is refused at once, before its body is read: a 503 then costs almost nothing, where a request
queued in Serve's router keeps probing the chat replicas for room (and under a retry storm those probes, not
the model, saturate the machine; bench/README.md). A refusal is answered after `refusal_delay_s`: a client that
resends at once, ignoring Retry-After, then costs one cheap refusal per delay instead of one per round trip.
limit None: no limit here (Serve's queue decides). `on_change(admission)` is called whenever `in_flight` or
`waiting` changes (the Ingress sets its gauges there; a refusal changes neither) and `on_refusal()` at each
refusal.
"""
from __future__ import annotations

import asyncio
import collections
from typing import Callable

from ray.serve.metrics import Counter

from .errors import APIError, error, error_response


GENERATION_ROUTES = frozenset(("/v1/chat/completions", "/v1/completions", "/v1/responses"))
REFUSAL = error("the chat model is at capacity; retry shortly", "overloaded_error", code="overloaded")


class Admission:
    def __init__(self, limit: int | None, waiting: int, refusal_delay_s: float = 0.0,
                 on_change: Callable[["Admission"], None] | None = None,
                 on_refusal: Callable[[], None] | None = None):
        self.limit, self.max_waiting, self.refusal_delay_s = limit, waiting, refusal_delay_s
        self.free = limit or 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._changed = on_change or (lambda admission: None)
        self._refused = on_refusal or (lambda: None)

    @property
    def in_flight(self) -> int:
        return (self.limit or 0) - self.free

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def full(self) -> bool:
        """No slot and no waiting place: the next generation would be refused."""
        return self.limit is not None and self.free <= 0 and len(self._waiters) >= self.max_waiting

    async def refusal(self) -> dict:
        """Count a refusal, wait `refusal_delay_s`, and give the error body to answer it with."""
        self._refused()
        if self.refusal_delay_s:
            await asyncio.sleep(self.refusal_delay_s)
        return REFUSAL

    async def enter(self) -> "Slot":
        if self.limit is None:
            return Slot(None)
        if self.free > 0:
            self.free -= 1
            self._changed(self)
            return Slot(self)
        if self.full:
            raise APIError(await self.refusal())
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._changed(self)
        try:
            await fut                       # a leaving slot is handed over to us
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._leave()               # handed over just as we gave up: pass it on
            else:
                self._waiters.remove(fut)
                self._changed(self)
            raise
        return Slot(self)

    def _leave(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                self._changed(self)
                return
        self.free += 1
        self._changed(self)


class Slot:
    """One admitted generation; `release` gives the slot back, once, however often it is called (and when the
    slot is dropped unreleased, e.g. with a response stream that never started)."""

    def __init__(self, admission: Admission | None):
        self._admission = admission

    def release(self) -> None:
        admission, self._admission = self._admission, None
        if admission is not None:
            admission._leave()

    def __del__(self):
        self.release()


class RefuseWhenFull:
    """Plain ASGI in front of FastAPI: a generation when no chat model's admission has a slot or a waiting place
    is answered 503 here, before routing, the request object, the handler and the exception handlers
    (bench.refusals: the Ingress's CPU per refusal); with one chat model, every generation its admission would
    refuse. A request whose key is wrong goes on, to get its 401. The admissions and the key check are the app's
    `state.ingress` (its `chat_full`, `chat_refusal` and `authorized`)."""

    def __init__(self, asgi):
        self.asgi = asgi

    async def __call__(self, scope, receive, send):
        ingress = getattr(scope["app"].state, "ingress", None) if scope["type"] == "http" else None
        if (ingress is not None and ingress.chat_full and scope["method"] == "POST"
                and scope["path"].removeprefix(scope.get("root_path", "")) in GENERATION_ROUTES
                and ingress.authorized(dict(scope["headers"]).get(b"authorization", b"").decode("latin-1"))):
            await error_response(await ingress.chat_refusal())(scope, receive, send)
            return
        await self.asgi(scope, receive, send)


class Tally:
    """A Prometheus counter that also keeps this replica's own total (shown by /debug/stats)."""

    def __init__(self, name: str, description: str):
        self.metric, self.total = Counter(name, description), 0

    def inc(self) -> None:
        self.metric.inc()
        self.total += 1
