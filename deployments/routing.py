"""A Ray Serve request router that sends the turns of a conversation to the chat replica that holds them.

Each chat replica's engine keeps the keys and values of finished requests in cached blocks (core/chat/block_pool.py), so the
next turn of a conversation, which resends the whole history, only computes what is new, if it lands on the
same replica. Serve's default router picks the less loaded of two random replicas and so scatters a
conversation over all of them.

`ConversationAffinityRouter` (configured per deployment: `request_router_config.request_router_class`) keys a
chat request by the chained hashes of its messages (messages[:1], messages[:2], ...) and a text completion by
its prompt's text in blocks; it remembers, for every key it routed, which replica took it, in a bounded LRU.
A request whose longest known key points at a live replica goes there first; the others are the second rank,
from which Serve picks the less loaded of two as usual, so a holder that is full (its `max_ongoing_requests`
reached) or far busier than the rest (`imbalance` more requests than the least loaded, by the router's cache
of queue lengths) does not hold a conversation hostage. Requests without history are balanced as by default.

Two details of Serve's routing loop matter here. A replica whose queue length is not cached is probed with a
deadline (0.1 s, doubled on each round); a holder that misses it on a busy host would lose its conversation,
so the holder is tried alone for the first `holder_rounds` rounds (3: 0.1 + 0.2 + 0.4 s of deadlines), each
started at once with the longer deadline, and with the others only after that. And Serve backs off between
rounds only when the router says so (`routing_context.should_backoff`, which its own routers set when they
offer every replica): without it, a request that finds every replica full re-probes them in a busy loop
(tests/test_routing.py counts).

Ray ships `PrefixCacheAffinityRouter` (ray.serve.llm.request_router) for the same purpose; it reads a routed
request's `messages`/`prompt` attributes, matches characters in a tree held by a detached actor and calls
`ray.get` on it while routing, blocking the caller's event loop (here the Ingress's, which relays every
stream). This router keeps its state in the routing process and matches whole messages, which is how a chat
client extends a conversation.
"""
from __future__ import annotations

import json
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from core.chat.protocol import GenerateRequest

PROMPT_BLOCK_CHARS = 256


def conversation_keys(request: Any) -> list[int]:
    """The request's keys, shortest first: one per message prefix for chat, per prompt-text block for text."""
    if not isinstance(request, GenerateRequest):
        return []
    keys, h = [], 0
    if request.messages:
        for m in request.messages:
            h = hash((h, json.dumps(m, sort_keys=True, ensure_ascii=False)))
            keys.append(h)
    elif request.prompts:
        first = request.prompts[0]
        text = first if isinstance(first, str) else json.dumps(first)
        for i in range(0, len(text) - PROMPT_BLOCK_CHARS + 1, PROMPT_BLOCK_CHARS):
            h = hash((h, text[i:i + PROMPT_BLOCK_CHARS]))
            keys.append(h)
    return keys


@dataclass
class _Routing:
    """A request being routed: its keys, computed once (routing may take several rounds, and
    on_request_routed needs them again), and how many rounds its holder was offered alone in."""
    keys: list[int]
    holder_offers: int = 0          # rounds in which its holder was offered alone


class ConversationAffinityRouter(RequestRouter):
    def initialize_state(self, max_keys: int = 200_000, imbalance: int = 8, holder_rounds: int = 3):
        self._owner: OrderedDict[int, ReplicaID] = OrderedDict()
        self._max_keys = max_keys
        self._imbalance = imbalance
        self._holder_rounds = holder_rounds
        # bounded for requests cancelled before they are routed
        self._pending: OrderedDict[str, _Routing] = OrderedDict()

    def _routing(self, pending_request: PendingRequest | None, done: bool = False) -> _Routing:
        """The routing state of a request (popped with `done`)."""
        if pending_request is None or not pending_request.args:
            return _Routing([])
        rid = pending_request.metadata.internal_request_id
        entry = self._pending.pop(rid, None) if done else self._pending.get(rid)
        if entry is None:
            entry = _Routing(conversation_keys(pending_request.args[0]))
            if not done:
                self._pending[rid] = entry
                while len(self._pending) > 10_000:
                    self._pending.popitem(last=False)
        return entry

    def holder(self, keys: list[int], candidates: dict[ReplicaID, RunningReplica]) -> RunningReplica | None:
        """The live replica that took this conversation's longest known prefix."""
        for key in reversed(keys):
            rid = self._owner.get(key)
            if rid is not None and rid in candidates:
                self._owner.move_to_end(key)
                return candidates[rid]
        return None

    def _too_busy(self, holder: RunningReplica, candidates: list[RunningReplica]) -> bool:
        cache = self._replica_queue_len_cache
        lens = [cache.get(r.replica_id) for r in candidates]
        mine = cache.get(holder.replica_id)
        known = [x for x in lens if x is not None]
        return mine is not None and bool(known) and mine - min(known) > self._imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        routing = self._routing(pending_request)
        holder = self.holder(routing.keys, by_id)
        if holder is not None and self._too_busy(holder, candidate_replicas):
            holder = None
        if holder is not None and routing.holder_offers < self._holder_rounds:
            routing.holder_offers += 1       # the holder alone, the next round without a back-off
            self._backoff_after(pending_request, False)
            return [[holder]]
        self._backoff_after(pending_request, True)
        others = [r for r in candidate_replicas if holder is None or r.replica_id != holder.replica_id]
        balanced = random.sample(others, min(2, len(others)))
        if holder is None:
            return [balanced]
        return [[holder], balanced] if balanced else [[holder]]

    @staticmethod
    def _backoff_after(pending_request: PendingRequest | None, backoff: bool) -> None:
        """Whether Serve waits (exponential back-off) before the next round if this one finds no replica."""
        if pending_request is not None:
            pending_request.routing_context.should_backoff = backoff

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        for key in self._routing(pending_request, done=True).keys:
            self._owner[key] = replica_id
            self._owner.move_to_end(key)
        while len(self._owner) > self._max_keys:
            self._owner.popitem(last=False)
