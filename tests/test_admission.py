"""The Ingress's chat admission: bounded in flight, bounded waiting, refusals at once, slots always returned."""
import asyncio
import gc

import pytest

from ray.exceptions import ActorUnavailableError

from core.chat.protocol import Delta, GenerateRequest, SamplingParams, StreamError, encode_message
from deployments.admission import Admission
from deployments.errors import APIError
from deployments.resume import ChatStream, RetryPolicy


def test_limits_waiting_refusal_and_hand_over():
    async def main():
        seen = []          # what the Ingress's gauges would show, at each change, and its refusals
        adm = Admission(limit=2, waiting=1, on_change=lambda ad: seen.append((ad.in_flight, ad.waiting)),
                        on_refusal=lambda: seen.append("refused"))
        a, b = await adm.enter(), await adm.enter()
        assert adm.in_flight == 2
        third = asyncio.ensure_future(adm.enter())
        await asyncio.sleep(0)
        assert not third.done()                           # waits for a slot
        with pytest.raises(APIError) as e:                # nobody else may wait: refused at once
            await adm.enter()
        assert e.value.body["error"]["type"] == "overloaded_error"
        a.release()
        a.release()                                       # twice is once
        c = await asyncio.wait_for(third, 1)              # the slot went to the waiter
        assert adm.in_flight == 2
        b.release()
        c.release()
        assert adm.in_flight == 0 and adm.free == 2
        # a refusal changes no gauge; the hand-over moves a waiter in flight (2 in flight, none waiting)
        assert seen == [(1, 0), (2, 0), (2, 1), "refused", (2, 0), (1, 0), (0, 0)]

    asyncio.run(main())


def test_a_cancelled_waiter_and_a_dropped_slot_give_their_slots_back():
    async def main():
        seen = []
        adm = Admission(limit=1, waiting=4, on_change=lambda ad: seen.append((ad.in_flight, ad.waiting)))
        held = await adm.enter()
        waiter = asyncio.ensure_future(adm.enter())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        del held
        gc.collect()                                      # a slot nobody released (a stream that never started)
        assert adm.free == 1
        again = await asyncio.wait_for(adm.enter(), 1)
        again.release()
        assert seen == [(1, 0), (1, 1), (1, 0), (0, 0), (1, 0), (0, 0)]

    asyncio.run(main())


def test_no_limit_admits_everything():
    async def main():
        adm = Admission(limit=None, waiting=0)
        slots = [await asyncio.wait_for(adm.enter(), 1) for _ in range(100)]    # none waits
        assert len(slots) == 100 and adm.waiting == 0 and not adm.full         # nothing is counted without a limit
        for s in slots:
            s.release()
        assert adm.in_flight == 0 and adm.free == 0

    asyncio.run(main())


# ---- ChatStream: a generation continued on another replica when its replica is lost
class Lost(ActorUnavailableError):
    """What a streaming handle raises when the replica under it is gone."""

    def __init__(self):
        super().__init__("the replica is gone", None)


class ScriptedHandle:
    """Stands in for the chat deployment's streaming handle: each call plays the next script, a list of event
    batches where an exception is raised in its place (a lost replica)."""

    def __init__(self, scripts):
        self.scripts, self.payloads, self.cancelled = list(scripts), [], 0
        self.generate = self

    def remote(self, payload):
        self.payloads.append(payload)
        return ScriptedStream(self, self.scripts.pop(0))


class ScriptedStream:
    def __init__(self, handle, script):
        self.handle, self.script = handle, list(script)

    async def __anext__(self):
        if not self.script:
            raise StopAsyncIteration
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return encode_message(item)         # what the chat deployment sends

    def cancel(self):
        self.handle.cancelled += 1


def tok(t, finish=None):
    return Delta(0, (t,), str(t), finish_reason=finish)


def request(**params):
    return GenerateRequest(SamplingParams(**params), messages=())


def test_a_lost_replica_is_continued_from_the_tokens_received():
    handle = ScriptedHandle([
        [[tok(5), tok(6)], [tok(7)], Lost()],       # dies after three tokens
        [Lost()],                                   # the retry lands on the dead replica too
        [[tok(8)], [tok(9, "length")]],             # another replica finishes it
    ])
    moved = []

    async def main():
        stream = ChatStream(handle, request(seed=1), RetryPolicy(5.0), True, on_continue=lambda: moved.append(1))
        batches = [await stream.start()]
        while True:
            try:
                batches.append(await stream.__anext__())
            except StopAsyncIteration:
                return stream, batches

    stream, batches = asyncio.run(main())
    assert [t for b in batches for ev in b for t in ev.tokens] == [5, 6, 7, 8, 9]
    assert handle.payloads[0].resume == ()
    assert handle.payloads[1].resume == handle.payloads[2].resume == (5, 6, 7)
    assert handle.payloads[2].params == SamplingParams(seed=1) and stream.continued == 1 and moved == [1]


def test_a_replica_whose_engine_stopped_counts_as_lost():
    """The replica's engine died under the stream (Ray killing the replica can take its child first): the
    replica's last message says so, and the stream goes on on another replica as for a lost one; a replica
    that answers a new stream so is passed over too. A stream that cannot be continued gets the error."""
    from core.chat.protocol import EngineDied
    from deployments.chat import ENGINE_STOPPED, refusal

    handle = ScriptedHandle([
        [[tok(5), tok(6)], [ENGINE_STOPPED]],       # its engine stopped after two tokens
        [[refusal(EngineDied("gone"))]],            # the retry lands on that replica: a refusal, not an answer
        [[tok(7)], [tok(8, "length")]],             # another replica finishes it
    ])

    async def main(stream):
        batches = [await stream.start()]
        while True:
            try:
                batches.append(await stream.__anext__())
            except StopAsyncIteration:
                return batches

    stream = ChatStream(handle, request(seed=2), RetryPolicy(5.0), True)
    batches = asyncio.run(main(stream))
    assert [t for b in batches for ev in b for t in ev.tokens] == [5, 6, 7, 8] and stream.continued == 1
    assert handle.payloads[1].resume == handle.payloads[2].resume == (5, 6)
    assert not any(isinstance(ev, StreamError) for b in batches for ev in b)
    plain = ChatStream(ScriptedHandle([[[tok(5)], [ENGINE_STOPPED]]]), request(), RetryPolicy(5.0), False)
    assert asyncio.run(main(plain))[-1] == [ENGINE_STOPPED]        # n > 1: not resumable, the error goes out


def test_a_stream_that_cannot_be_continued_raises():
    async def run(resumable, scripts, timeout=5.0):
        stream = ChatStream(ScriptedHandle(scripts), request(), RetryPolicy(timeout), resumable)
        await stream.start()
        return await stream.__anext__()

    with pytest.raises(Lost):                       # n > 1 or several prompts: not resumable
        asyncio.run(run(False, [[[tok(5)], Lost()]]))
    with pytest.raises(Lost):                       # it had already finished: nothing to continue
        asyncio.run(run(True, [[[tok(5, "stop")], Lost()]]))
    with pytest.raises(APIError) as e:              # no replica takes it within retry_timeout_s
        asyncio.run(run(True, [[[tok(5)], Lost()]] + [[Lost()]] * 50, timeout=0.2))
    assert e.value.body["error"]["code"] == "unavailable"


class FakeIngress:
    def __init__(self, admission, keys=()):
        self.admission, self.keys = admission, keys

    @property
    def chat_full(self) -> bool:
        return self.admission.full

    async def chat_refusal(self) -> dict:
        return await self.admission.refusal()

    def authorized(self, header: str) -> bool:
        return not self.keys or header.removeprefix("Bearer ") in self.keys


def asgi_call(asgi, method, path, headers=(), root_path="", app=None):
    """One request through an ASGI callable: the messages it sent."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": root_path + path, "root_path": root_path,
             "headers": list(headers), "query_string": b"", "app": app}
    asyncio.run(asgi(scope, receive, send))
    return sent


def test_a_full_admission_refuses_generations_before_the_app():
    """RefuseWhenFull answers a generation route's POST with 503 when the admission is full, without calling the
    app; anything else (other routes, a free slot, a wrong key) goes on to the app."""
    from deployments.admission import RefuseWhenFull
    from deployments.ingress import app

    reached = []

    async def inner(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    refusals = []
    full = Admission(limit=0, waiting=0, on_refusal=lambda: refusals.append(1))
    guard = RefuseWhenFull(inner)
    try:
        app.state.ingress = FakeIngress(full, keys=("k",))
        key = [(b"authorization", b"Bearer k")]
        for path, root in (("/v1/chat/completions", ""), ("/v1/completions", "/keyed")):
            sent = asgi_call(guard, "POST", path, key, root, app)
            assert sent[0]["status"] == 503 and (b"retry-after", b"1") in sent[0]["headers"]
            assert b"overloaded_error" in sent[1]["body"]
        assert reached == [] and len(refusals) == 2
        for method, path, headers in (("POST", "/v1/systemone", key), ("GET", "/v1/chat/completions", key),
                                      ("POST", "/v1/chat/completions", [(b"authorization", b"Bearer nope")])):
            assert asgi_call(guard, method, path, headers, app=app)[0]["status"] == 299
        app.state.ingress = FakeIngress(Admission(limit=1, waiting=0))
        assert asgi_call(guard, "POST", "/v1/chat/completions", app=app)[0]["status"] == 299
        assert len(reached) == 4 and len(refusals) == 2
    finally:
        del app.state.ingress


def test_a_refusal_is_answered_after_the_refusal_delay(monkeypatch):
    """A refused generation waits `refusal_delay_s` (asyncio.sleep with that delay) before its 503; no delay, no
    wait. The sleep is recorded, not timed."""
    import deployments.admission as admission

    slept = []

    async def sleep(s):
        slept.append(s)
    monkeypatch.setattr(admission.asyncio, "sleep", sleep)

    async def refuse(delay):
        adm = Admission(limit=1, waiting=0, refusal_delay_s=delay)
        slot = await adm.enter()
        with pytest.raises(APIError) as e:
            await adm.enter()
        slot.release()
        return e.value.body["error"]["type"]
    assert asyncio.run(refuse(0.2)) == "overloaded_error" and slept == [0.2]
    assert asyncio.run(refuse(0.0)) == "overloaded_error" and slept == [0.2]
