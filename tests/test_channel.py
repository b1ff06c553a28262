"""The token channel (deployments/channel.py): frames, the handshake, lost connections, and a ChatStream whose
messages come on it, continued on another replica when the channel under it is lost."""
from __future__ import annotations

import asyncio
import struct

import pytest
from ray.exceptions import ActorUnavailableError

from core.chat.protocol import ChannelTicket, Delta, GenerateRequest, OnChannel, SamplingParams, encode_message
from deployments.channel import END, ChannelLost, ChannelPool, ChannelServer
from deployments.resume import ChatStream, RetryPolicy


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_one_frame_per_loop_turn_carries_every_streams_messages_in_order():
    async def main():
        server = ChannelServer()
        opened = [await server.open() for _ in range(3)]
        pool = ChannelPool()
        channels = [await pool.get(ticket) for ticket, _ in opened]
        assert channels[0] is channels[1] is channels[2]       # one connection per Ingress replica
        for turn in range(4):
            for k, (ticket, _) in enumerate(opened):
                channels[0].put(ticket.stream, b"%d:%d" % (k, turn))
            await asyncio.sleep(0.02)                           # the next loop turn sends the frame
        channels[0].put(opened[1][0].stream, END)
        got = []
        for k, (_, sink) in enumerate(opened):
            got.append([await sink.get() for _ in range(4 + (k == 1))])
        stats = server.stats()
        await server.stop()
        pool.close()
        return got, stats

    got, stats = run(main())
    assert got == [[b"0:0", b"0:1", b"0:2", b"0:3"], [b"1:0", b"1:1", b"1:2", b"1:3", END],
                   [b"2:0", b"2:1", b"2:2", b"2:3"]]
    assert stats["frames"] == 5 and stats["messages"] == 13 and stats["connections"] == 1


def test_only_an_end_that_holds_the_key_gets_through():
    async def main():
        server = ChannelServer()
        ticket, sink = await server.open()
        forged = ChannelTicket(ticket.host, ticket.port, b"\0" * 32, ticket.stream)
        with pytest.raises((PermissionError, asyncio.IncompleteReadError, ConnectionError)):
            await ChannelPool().get(forged)
        # a client that skips the handshake and sends a frame at once is cut off before it is read
        reader, writer = await asyncio.open_connection(ticket.host, ticket.port)
        payload = encode_message([[ticket.stream, b"injected"]])
        writer.write(b"\0" * 32 + b"\0" * 32 + struct.pack(">I", len(payload)) + payload)
        await reader.read()                                     # the server closes the connection
        writer.close()
        # and a server that does not hold the key gets nothing from a chat replica
        impostor = ChannelServer()
        await impostor.start()
        with pytest.raises((PermissionError, asyncio.IncompleteReadError, ConnectionError)):
            await ChannelPool().get(ChannelTicket(impostor.host, impostor.port, ticket.key, 1))
        stats = server.stats()
        await server.stop()
        await impostor.stop()
        return list(sink.items), stats

    items, stats = run(main())
    assert items == [] and stats["frames"] == 0 and stats["connections"] == 0


def test_a_lost_connection_fails_the_streams_it_carried_and_no_others():
    async def main():
        server = ChannelServer()
        (t1, s1), (t2, s2), (t3, s3) = [await server.open() for _ in range(3)]
        pool = ChannelPool()
        channel = await pool.get(t1)
        channel.put(t1.stream, b"a")
        channel.put(t2.stream, b"b")
        channel.put(t2.stream, END)            # t2 ended before the loss
        server.close(t3.stream)                # t3 was cancelled: its messages are dropped
        channel.put(t3.stream, b"c")
        await asyncio.sleep(0.02)
        channel.writer.close()                 # the chat replica dies
        assert await s1.get() == b"a"
        lost = await s1.get()
        await server.stop()
        # and a chat replica forgets a channel whose Ingress replica went away (here: closed by the Ingress)
        other = ChannelServer()
        ticket, _ = await other.open()
        await pool.get(ticket)
        while other.connections < 1:           # the Ingress's end finishes its half of the handshake
            await asyncio.sleep(0.005)
        entries = len(pool.channels)
        await other.stop()
        await asyncio.sleep(0.05)
        return lost, list(s2.items), list(s3.items), entries, len(pool.channels)

    lost, rest2, rest3, entries, left = run(main())
    assert isinstance(lost, ChannelLost)
    assert rest2 == [b"b", END] and rest3 == []
    assert entries >= 1 and left == entries - 1


def tok(t, finish=None):
    return Delta(0, (t,), str(t), finish_reason=finish)


class Lost(ActorUnavailableError):
    """What a streaming handle raises when the replica under it is gone."""

    def __init__(self):
        super().__init__("the replica is gone", None)


class ChannelHandle:
    """Stands in for the chat deployment's handle, as replicas that take the token channel: each call plays the
    next script, its first message through "Serve" (marked OnChannel) and the rest on the request's channel.
    "drop" in a script closes the replica's connection (the replica died), after which its Serve call fails."""

    def __init__(self, scripts):
        self.scripts, self.payloads = list(scripts), []
        self.generate = self

    def remote(self, payload):
        self.payloads.append(payload)
        return ReplicaStream(payload, self.scripts.pop(0))


class ReplicaStream:
    def __init__(self, request: GenerateRequest, script: list):
        self.request, self.script, self.first = request, script, True
        self.died = asyncio.get_running_loop().create_future()

    async def _rest(self):
        pool = ChannelPool()
        channel = await pool.get(self.request.channel)
        for item in self.script[1:]:
            if item == "drop":
                channel.writer.close()
                self.died.set_result(None)
                return
            channel.put(self.request.channel.stream, encode_message(item))
            await asyncio.sleep(0.005)
        channel.put(self.request.channel.stream, END)

    async def __anext__(self):
        if self.first:
            self.first = False
            self.task = asyncio.ensure_future(self._rest())
            return encode_message([OnChannel()] + self.script[0])
        await self.died                          # the Serve call fails only when the replica dies
        raise Lost()

    def __aiter__(self):
        return self

    def cancel(self):
        pass


def test_a_stream_on_the_channel_continues_on_another_replica_when_the_channel_is_lost():
    async def main():
        server = ChannelServer()
        handle = ChannelHandle([
            [[tok(5)], [tok(6)], [tok(7)], "drop"],      # the replica dies after three tokens
            [[tok(8)], [tok(9, "length")]],             # another one finishes from them
        ])
        request = GenerateRequest(SamplingParams(seed=1), messages=())
        stream = ChatStream(handle, request, RetryPolicy(5.0), True, channel=server)
        batches = [await stream.start()]
        while True:
            try:
                batches.append(await stream.__anext__())
            except StopAsyncIteration:
                break
        stream.cancel()
        open_streams = len(server.sinks)
        await server.stop()
        return handle, stream, batches, open_streams

    handle, stream, batches, open_streams = run(main())
    assert [t for b in batches for ev in b for t in ev.tokens] == [5, 6, 7, 8, 9]
    first, second = handle.payloads
    assert first.channel is not None and second.channel is not None and first.channel.stream != second.channel.stream
    assert second.resume == (5, 6, 7) and stream.continued == 1 and open_streams == 0
