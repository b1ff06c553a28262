"""The token channel: a chat replica's streams reach an Ingress replica on one connection, one frame per turn of
the replica's event loop.

Through Serve, every message of every stream is a gRPC stream message: Serve's per-message work on both sides
was most of what a relayed token cost (bench/README.md, "The per-token path"). Serve still routes, counts and
cancels each generation (the chat replica's `generate` runs until its engine stream ends and carries its first
message and any refusal), but with a channel the messages after the first go here instead: each Ingress replica
listens on a port of its node (`ChannelServer`), puts a `ChannelTicket` (its address, a per-replica key, the
request's stream number) into each `GenerateRequest`, and a chat replica keeps one connection per Ingress
replica (`ChannelPool`) on which all of its streams' messages of one loop turn leave as one frame.

Both ends prove they hold the key before anything else crosses (an HMAC of the other end's random challenge):
the key only ever travels inside requests on Ray's own authenticated connections, so a process that can reach
the port but not the cluster can neither feed tokens to an Ingress nor receive them. A frame is a 4-byte
length and a msgpack list of [stream number, message]; a message is the same msgpack record list the Serve
path carries, and an empty one ends its stream. A lost connection fails every stream the Ingress received on
it, which the Ingress treats as a lost replica (resume.py).
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import itertools
import logging
import os
import struct

import msgspec

from core.chat.protocol import ChannelTicket

logger = logging.getLogger(__name__)

CHALLENGE_BYTES = 32
MAX_FRAME_BYTES = 64 << 20           # one loop turn's messages; far above what a turn produces
HIGH_WATER_BYTES = 4 << 20           # a stream waits when this much is queued on its connection
END = b""                            # the message that ends a stream
_HEADER = struct.Struct(">I")
_FRAME = msgspec.msgpack.Decoder(list[tuple[int, bytes]])
_ENCODE = msgspec.msgpack.Encoder().encode


class ChannelLost(ConnectionError):
    """The connection that carried a stream's messages is gone (its chat replica, or the link)."""


def _proof(key: bytes, challenge: bytes) -> bytes:
    return hmac.new(key, challenge, hashlib.sha256).digest()


async def _prove(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes) -> None:
    """The handshake, the same from both ends: send a challenge, answer the other's, check its answer."""
    mine = os.urandom(CHALLENGE_BYTES)
    writer.write(mine)
    theirs = await reader.readexactly(CHALLENGE_BYTES)
    writer.write(_proof(key, theirs))
    answer = await reader.readexactly(len(_proof(key, b"")))
    if not hmac.compare_digest(answer, _proof(key, mine)):
        raise PermissionError("the other end of a token channel does not hold its key")


class Sink:
    """One stream's messages as they arrive at the Ingress, from its channel and from its Serve call alike:
    bytes (an encoded message; END ends the stream) or an exception to raise to the reader."""

    __slots__ = ("items", "waiter", "source")

    def __init__(self) -> None:
        self.items: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None
        self.source: object | None = None   # the connection its messages came on (failed with it)

    def put(self, item) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self):
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


class ChannelServer:
    """The Ingress replica's end: a listening socket on `host`, a key, and the sinks of its open streams.
    Started on first use, on the loop that uses it."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host, self.key = host, os.urandom(32)
        self.port = 0
        self.sinks: dict[int, Sink] = {}
        self._numbers = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None
        self._starting: asyncio.Lock | None = None
        self.connections = 0              # chat replicas connected now
        self._writers: set[asyncio.StreamWriter] = set()
        self.frames = self.messages = 0   # received since start (the Ingress's /debug/stats)

    async def start(self) -> None:
        if self._server is not None:
            return
        self._starting = self._starting or asyncio.Lock()
        async with self._starting:
            if self._server is None:
                self._server = await asyncio.start_server(self._serve, self.host, 0)
                self.port = self._server.sockets[0].getsockname()[1]
                logger.info("token channel listening on %s:%d", self.host, self.port)

    async def open(self) -> tuple[ChannelTicket, Sink]:
        """A new stream's ticket (for its GenerateRequest) and the sink its messages arrive in."""
        await self.start()
        number = next(self._numbers)
        sink = self.sinks[number] = Sink()
        return ChannelTicket(self.host, self.port, self.key, number), sink

    def close(self, number: int) -> None:
        """The stream is done with (ended, cancelled or moved): later messages for it are dropped."""
        self.sinks.pop(number, None)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)         # from the start: stop() closes connections still in the handshake
        try:
            await asyncio.wait_for(_prove(reader, writer, self.key), 10)
        except (Exception, asyncio.TimeoutError) as e:
            logger.warning("token channel: refused a connection from %s: %r", writer.get_extra_info("peername"), e)
            self._writers.discard(writer)
            writer.close()
            return
        self.connections += 1
        sinks, source = self.sinks, object()
        try:
            while True:
                (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                if size > MAX_FRAME_BYTES:
                    raise ValueError(f"a token channel frame of {size} bytes")
                items = _FRAME.decode(await reader.readexactly(size))
                self.frames += 1
                self.messages += len(items)
                for number, message in items:
                    sink = sinks.get(number)
                    if sink is not None:
                        sink.source = source
                        sink.put(message)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, msgspec.DecodeError) as e:
            # every open stream this connection carried fails (the closed ones are gone from `sinks`)
            lost = ChannelLost(f"the token channel from a chat replica closed ({type(e).__name__})")
            for sink in list(sinks.values()):
                if sink.source is source and not (sink.items and sink.items[-1] == END):
                    sink.put(lost)
        finally:
            self.connections -= 1
            self._writers.discard(writer)
            writer.close()

    def stats(self) -> dict:
        return {"address": f"{self.host}:{self.port}", "connections": self.connections, "open_streams": len(self.sinks),
                "frames": self.frames, "messages": self.messages}

    async def stop(self) -> None:
        """Stop listening and close the chat replicas' connections (their streams end as lost)."""
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None


class Channel:
    """A chat replica's connection to one Ingress replica: messages put during a turn of the event loop leave
    together, as one frame, at the start of the next turn."""

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.pending: list[tuple[int, bytes]] = []
        self.closed = False
        self.watcher: asyncio.Future | None = None    # ends when the Ingress closes the connection

    def put(self, number: int, message: bytes) -> None:
        if self.closed:
            raise ChannelLost("the token channel to the Ingress is closed")
        if not self.pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self.pending.append((number, message))

    def _flush(self) -> None:
        if self.closed or not self.pending:
            return
        payload = _ENCODE(self.pending)
        self.pending = []
        try:
            self.writer.write(_HEADER.pack(len(payload)) + payload)
        except (ConnectionError, RuntimeError):
            self.closed = True

    async def sent(self) -> None:
        """Wait for the next loop turn's frame to be written; raise ChannelLost if the connection is gone."""
        await asyncio.sleep(0)
        self._check()

    async def drained(self) -> None:
        """Wait while the connection has too much unsent (an Ingress that does not keep up)."""
        transport = self.writer.transport
        if transport.get_write_buffer_size() > HIGH_WATER_BYTES:
            await self.writer.drain()
        self._check()

    def _check(self) -> None:
        if self.closed or self.writer.is_closing():
            self.closed = True
            raise ChannelLost("the token channel to the Ingress is closed")


class ChannelPool:
    """A chat replica's channels, one per Ingress replica (by address and key), opened on first use."""

    def __init__(self, timeout_s: float = 5.0):
        self.timeout_s = timeout_s
        self.channels: dict[tuple[str, int, bytes], Channel] = {}
        self._opening: dict[tuple[str, int, bytes], asyncio.Future] = {}

    async def get(self, ticket: ChannelTicket) -> Channel:
        key = (ticket.host, ticket.port, ticket.key)
        channel = self.channels.get(key)
        if channel is not None and not channel.closed and not channel.writer.is_closing():
            return channel
        opening = self._opening.get(key)
        if opening is None:
            opening = self._opening[key] = asyncio.ensure_future(self._connect(ticket))
            opening.add_done_callback(lambda _: self._opening.pop(key, None))
        return await asyncio.shield(opening)

    async def _connect(self, ticket: ChannelTicket) -> Channel:
        async def connect():
            reader, writer = await asyncio.open_connection(ticket.host, ticket.port)
            try:
                await _prove(reader, writer, ticket.key)
            except BaseException:
                writer.close()
                raise
            return reader, writer
        reader, writer = await asyncio.wait_for(connect(), self.timeout_s)
        key = (ticket.host, ticket.port, ticket.key)
        channel = self.channels[key] = Channel(writer)

        async def watch():                # the Ingress never writes after the handshake: a read ends on close
            try:
                await reader.read()
            finally:
                channel.closed = True
                writer.close()
                if self.channels.get(key) is channel:   # an Ingress replica that has gone leaves no entry
                    del self.channels[key]
        channel.watcher = asyncio.ensure_future(watch())
        return channel

    def close(self) -> None:
        for channel in self.channels.values():
            channel.closed = True
            channel.writer.close()
        self.channels.clear()
