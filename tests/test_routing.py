"""ConversationAffinityRouter inside Serve's own routing loop (RequestRouter._choose_replica_for_request, with
its queue-length cache, probes, deadlines and back-off), against fake replicas that answer probes as told."""
from __future__ import annotations

import asyncio
import itertools

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve._private.request_router.common import PendingRequest

from core.chat.protocol import GenerateRequest, SamplingParams
from deployments.routing import ConversationAffinityRouter
from tests.waiting import until


def chat_request(messages):
    return GenerateRequest(SamplingParams(), messages=tuple(messages))

DEPLOYMENT = DeploymentID(name="ChatModel", app_name="test")
_ids = itertools.count()


class FakeReplica:
    """What Serve's router asks of a replica: its id, its limit and its queue length (a probe)."""

    def __init__(self, name: str, queue_len: int = 0, max_ongoing_requests: int = 4):
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.max_ongoing_requests = max_ongoing_requests
        self.queue_len = queue_len
        self.probe_delays: list[float] = []    # how long the next probes take to answer (then at once)
        self.probes = 0

    async def get_queue_len(self, *, deadline_s: float) -> int:
        self.probes += 1
        if self.probe_delays:
            await asyncio.sleep(self.probe_delays.pop(0))
        return self.queue_len


def make_router(*replicas: FakeReplica) -> ConversationAffinityRouter:
    router = ConversationAffinityRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN,
                                        use_replica_queue_len_cache=True)
    router.initialize_state()
    router.update_replicas(list(replicas))
    return router


async def route(router: ConversationAffinityRouter, messages: list[dict]) -> str:
    """Route one chat request as Serve does, then report it accepted; -> the replica's name."""
    rid = str(next(_ids))
    pending = PendingRequest(args=[chat_request(messages)], kwargs={},
                             metadata=RequestMetadata(request_id=rid, internal_request_id=rid))
    replica = await router._choose_replica_for_request(pending)
    router.on_request_routed(pending, replica.replica_id, None)
    return replica.replica_id.unique_id


def turn(history: list[dict], n: int) -> list[dict]:
    return history + [{"role": "assistant", "content": f"reply {n}"}, {"role": "user", "content": f"more {n}"}]


def test_a_conversation_goes_back_to_the_replica_that_took_it():
    async def main():
        a, b = FakeReplica("a"), FakeReplica("b")
        router = make_router(a, b)
        conversations = [[{"role": "user", "content": f"topic {i}"}] for i in range(12)]
        first = [await route(router, c) for c in conversations]
        assert set(first) == {"a", "b"}                       # new conversations are balanced
        for n in range(3):
            conversations = [turn(c, n) for c in conversations]
            again = [await route(router, c) for c in conversations]
            assert again == first
    asyncio.run(main())


def test_a_holder_slow_to_answer_probes_keeps_its_conversation():
    """The holder's queue length is not cached and its first two probes miss Serve's deadlines (0.1 s, then
    0.2 s): the request waits for the next round (0.4 s) instead of moving to a replica without its cache."""
    async def main():
        a, b = FakeReplica("a"), FakeReplica("b")
        router = make_router(a, b)
        history = [{"role": "user", "content": "hello"}]
        holder = await route(router, history)
        slow = a if holder == "a" else b
        router._replica_queue_len_cache.invalidate_key(slow.replica_id)
        slow.probe_delays = [0.15, 0.3]
        assert await route(router, turn(history, 0)) == holder
        assert slow.probes >= 3                               # it was asked again, with longer deadlines
    asyncio.run(main())


@pytest.mark.parametrize("case", ["full", "far busier"])
def test_a_holder_that_cannot_take_more_gives_the_conversation_up(case):
    async def main():
        limit = 4 if case == "full" else 64
        a, b = FakeReplica("a", max_ongoing_requests=limit), FakeReplica("b", max_ongoing_requests=limit)
        router = make_router(a, b)
        history = [{"role": "user", "content": "hello"}]
        holder = await route(router, history)
        busy = a if holder == "a" else b
        busy.queue_len = 4 if case == "full" else 9           # 9 more than the other: over `imbalance` (8)
        router._replica_queue_len_cache.update(busy.replica_id, busy.queue_len)
        assert await route(router, turn(history, 0)) != holder
    asyncio.run(main())


def test_a_request_that_finds_every_replica_full_backs_off():
    """Serve waits between rounds only when the router asks for it; otherwise a waiting request re-probes
    every replica in a busy loop (tens of thousands of probes a second). Once one has room, it goes there."""
    async def main():
        a, b = FakeReplica("a", queue_len=4), FakeReplica("b", queue_len=4)
        router = make_router(a, b)
        history = [{"role": "user", "content": "hello"}]
        router.on_request_routed(PendingRequest(args=[chat_request(history)], kwargs={},
                                                metadata=RequestMetadata(request_id="x", internal_request_id="x")),
                                 a.replica_id, None)           # a holds the conversation
        backoffs = []                  # Serve's back-offs between rounds (RequestRouter._backoff), as it takes them
        serve_backoff = router._backoff

        async def backoff(attempt):
            backoffs.append(attempt)
            await serve_backoff(attempt)
        router._backoff = backoff
        task = asyncio.ensure_future(route(router, turn(history, 0)))
        await until(lambda: len(backoffs) >= 4, 30, "Serve never backed off between rounds")
        assert not task.done()
        # each round probes at most the two replicas, and every round after the holder's own ones backs off
        assert a.probes + b.probes <= 2 * (len(backoffs) + 5), (a.probes + b.probes, len(backoffs))
        b.queue_len = 1
        assert await asyncio.wait_for(task, 5) == "b"
    asyncio.run(main())
