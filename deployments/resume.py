"""Calls that outlive a lost replica: a retry policy, and a chat stream that continues on another replica.

A replica (or its node) can die under a call. Decisions are idempotent, so the call is simply made again; a
chat generation is continued from what it had delivered (`ChatStream`). Either way Serve routes the new call
to a healthy replica once it knows.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from core.chat.protocol import ENGINE_STOPPED_CODE, GenerateRequest, StreamError, decode_message

from .errors import APIError, error

logger = logging.getLogger(__name__)

class EngineStopped(Exception):
    """A chat replica answered that its engine has stopped: the replica is going down (its process, or Ray
    killing it, took the engine first), so the call goes to another one as for a lost replica."""


REPLICA_LOST = (RayActorError, ActorUnavailableError, EngineStopped)


class RetryPolicy:
    """Await a call; when the replica serving it is lost, make it again (with backoff) for up to `timeout_s`,
    then answer 503. Serve's own refusal (its queue is full) is a 503 at once."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    async def __call__(self, call: Callable[[], Awaitable], what: str):
        deadline = time.monotonic() + self.timeout_s
        attempt = 0
        while True:
            try:
                return await call()
            except BackPressureError:
                raise APIError(error("the service is at capacity; retry shortly", "overloaded_error",
                                     code="overloaded")) from None
            except REPLICA_LOST as e:
                attempt += 1
                if time.monotonic() >= deadline:
                    raise APIError(error(f"the {what} model is unavailable; retry shortly", "overloaded_error",
                                         code="unavailable")) from None
                logger.warning("%s replica lost (%s); retry %d", what, type(e).__name__, attempt)
                await asyncio.sleep(min(0.05 * 2 ** attempt, 2.0))


class ChatStream:
    """The records of one generation on the chat replicas, a list (Delta | StreamError) per message. When the replica
    streaming it is lost mid-way, the generation goes on on another one from the tokens received so far (the
    request's `resume`: the new replica prefills them after the prompt and replays their tool, text and sampler
    state), retried as `retry` says: the reader sees one uninterrupted stream, and a greedy or seeded generation
    gives the tokens an unbroken run would have. Only a generation of one prompt and one sample continues (the
    engine resumes one sample's state); another ends with the error, as does one whose retries run out.
    `on_continue()` is called each time the stream moves."""

    def __init__(self, handle: DeploymentHandle, request: GenerateRequest, retry: RetryPolicy, resumable: bool,
                 on_continue: Callable[[], None] | None = None):
        self.handle, self.request, self.retry, self.resumable = handle, request, retry, resumable
        self.on_continue = on_continue
        self.stream = None
        self.tokens: list[int] = []        # token ids received, in order (the one sample's)
        self.ended = False                 # a finish or an error was received
        self.continued = 0                 # times the generation moved to another replica
        self.started = False               # the first batch was delivered

    async def start(self) -> list:
        """The first batch of events; the start is retried while no replica answers."""
        batch = await self.retry(lambda: self._open(self.request), "chat")
        self.started = True
        return batch

    async def _open(self, request: GenerateRequest) -> list:
        self.cancel()
        self.stream = self.handle.generate.remote(request)
        return self._record(await self.stream.__anext__())

    def _record(self, message: bytes) -> list:
        """A message of the chat deployment -> its records (Delta | StreamError), the tokens noted. A replica's
        engine that stopped raises EngineStopped (a message of that error alone) where the stream can go on
        elsewhere: before anything was delivered, or when it is resumable."""
        batch = decode_message(message)
        for ev in batch:
            if isinstance(ev, StreamError):
                if ev.code == ENGINE_STOPPED_CODE and (self.resumable or not self.started) and len(batch) == 1:
                    raise EngineStopped(ev.message)
                self.ended = True
                continue
            self.tokens += ev.tokens
            if ev.finish_reason:
                self.ended = True
        return batch

    def __aiter__(self):
        return self

    async def __anext__(self) -> list:
        try:
            return self._record(await self.stream.__anext__())
        except REPLICA_LOST as e:
            if not self.resumable or self.ended:
                raise
            self.continued += 1
            if self.on_continue is not None:
                self.on_continue()
            logger.warning("chat replica lost mid-stream (%s) after %d tokens; continuing on another replica",
                           type(e).__name__, len(self.tokens))
            resumed = self.request.resumed(self.tokens)
            return await self.retry(lambda: self._open(resumed), "chat")

    def cancel(self) -> None:
        """Stop the generation on its replica (its rows are freed at the engine's next step)."""
        if self.stream is not None:
            self.stream.cancel()
