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

import msgspec
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from core.chat.protocol import ENGINE_STOPPED_CODE, GenerateRequest, OnChannel, StreamError, decode_message

from .channel import END, ChannelLost, ChannelServer, Sink
from .errors import APIError, error

logger = logging.getLogger(__name__)

class EngineStopped(Exception):
    """A chat replica answered that its engine has stopped: the replica is going down (its process, or Ray
    killing it, took the engine first), so the call goes to another one as for a lost replica."""


REPLICA_LOST = (RayActorError, ActorUnavailableError, EngineStopped, ChannelLost)


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
    `on_continue()` is called each time the stream moves.

    With `channel` (this Ingress replica's token channel), the request carries a ticket for it: a replica that
    takes it sends its first message through Serve, marked OnChannel, and the rest on the channel, where they
    arrive in this stream's sink; the Serve call stays open meanwhile (Serve counts it, and cancelling it stops
    the generation), and a task passes its failure, if any, into the sink."""

    def __init__(self, handle: DeploymentHandle, request: GenerateRequest, retry: RetryPolicy, resumable: bool,
                 on_continue: Callable[[], None] | None = None, channel: ChannelServer | None = None):
        self.handle, self.request, self.retry, self.resumable = handle, request, retry, resumable
        self.on_continue = on_continue
        self.channel = channel
        self.stream = None
        self.sink: Sink | None = None      # while the messages come on the channel
        self.number = 0                    # the stream's number on the channel
        self.watcher: asyncio.Task | None = None
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
        sink = None
        if self.channel is not None:
            ticket, sink = await self.channel.open()
            self.number = ticket.stream
            request = msgspec.structs.replace(request, channel=ticket)
        self.stream = stream = self.handle.generate.remote(request)
        try:
            batch = decode_message(await stream.__anext__())
        except BaseException:
            if sink is not None:
                self.channel.close(self.number)
            raise
        if batch and isinstance(batch[0], OnChannel):
            batch = batch[1:]
            self.sink = sink
            self.watcher = asyncio.ensure_future(_watch(stream, sink))
        elif sink is not None:             # the replica kept to the Serve call
            self.channel.close(self.number)
        return self._records(batch)

    def _records(self, batch: list) -> list:
        """A message's records (Delta | StreamError), the tokens noted. A replica's engine that stopped raises
        EngineStopped (a message of that error alone) where the stream can go on elsewhere: before anything was
        delivered, or when it is resumable."""
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

    async def _next_message(self) -> bytes:
        if self.sink is None:
            return await self.stream.__anext__()
        item = await self.sink.get()
        if isinstance(item, BaseException):
            raise item
        if item == END:
            raise StopAsyncIteration
        return item

    async def __anext__(self) -> list:
        try:
            return self._records(decode_message(await self._next_message()))
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
        if self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None
        if self.sink is not None:
            self.channel.close(self.number)
            self.sink = None
        if self.stream is not None:
            self.stream.cancel()


async def _watch(stream, sink: Sink) -> None:
    """While a stream's messages come on the channel: anything more its Serve call yields, and its failure,
    go into the sink (its normal end says nothing: the channel's END does)."""
    try:
        async for message in stream:
            sink.put(message)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        sink.put(e)
