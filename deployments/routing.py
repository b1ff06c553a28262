"""A Ray Serve request router that sends the turns of a conversation to the chat replica that holds them.

Each chat replica's engine keeps the keys and values of finished requests (core/chat/prefix_index.py), so the
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
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

PROMPT_BLOCK_CHARS = 256


def conversation_keys(payload: Any) -> list[int]:
    """The request's keys, shortest first: one per message prefix for chat, per prompt-text block for text."""
    if not isinstance(payload, dict):
        return []
    keys, h = [], 0
    if payload.get("messages"):
        for m in payload["messages"]:
            h = hash((h, json.dumps(m, sort_keys=True, ensure_ascii=False)))
            keys.append(h)
    elif payload.get("prompts"):
        first = payload["prompts"][0]
        text = first if isinstance(first, str) else json.dumps(first)
        for i in range(0, len(text) - PROMPT_BLOCK_CHARS + 1, PROMPT_BLOCK_CHARS):
            h = hash((h, text[i:i + PROMPT_BLOCK_CHARS]))
            keys.append(h)
    return keys


class ConversationAffinityRouter(RequestRouter):
    def initialize_state(self, max_keys: int = 200_000, imbalance: int = 8):
        self._owner: OrderedDict[int, ReplicaID] = OrderedDict()
        self._max_keys = max_keys
        self._imbalance = imbalance
        # keys of requests being routed, computed once per request (routing may try several times, and
        # on_request_routed needs them again); bounded for requests cancelled before they are routed
        self._pending: OrderedDict[str, list[int]] = OrderedDict()

    def _keys(self, pending_request: PendingRequest | None, done: bool = False) -> list[int]:
        if pending_request is None or not pending_request.args:
            return []
        rid = pending_request.metadata.internal_request_id
        keys = self._pending.pop(rid, None) if done else self._pending.get(rid)
        if keys is None:
            keys = conversation_keys(pending_request.args[0])
            if not done:
                self._pending[rid] = keys
                while len(self._pending) > 10_000:
                    self._pending.popitem(last=False)
        return keys

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
        holder = self.holder(self._keys(pending_request), by_id)
        others = [r for r in candidate_replicas if holder is None or r.replica_id != holder.replica_id]
        balanced = random.sample(others, min(2, len(others)))
        if holder is None or self._too_busy(holder, candidate_replicas):
            return [balanced] if balanced else [[holder]]
        return [[holder], balanced] if balanced else [[holder]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        for key in self._keys(pending_request, done=True):
            self._owner[key] = replica_id
            self._owner.move_to_end(key)
        while len(self._owner) > self._max_keys:
            self._owner.popitem(last=False)
