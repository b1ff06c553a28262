"""The decision deployment: one StartLuxDecision per replica, requests batched with @serve.batch.

Concurrent requests are collected into the scorer's `decide_batch` (which sends a batch of one through
`decide`, so on a GPU it replays a CUDA graph). `max_batch_size`, `batch_wait_timeout_s` and
`batches_in_flight` are live settings (`user_config` -> `reconfigure`, BatchSettings); the deployment's
`max_ongoing_requests` must be at least the batch size or batches could never fill.

Serve's batcher forms a batch as soon as its wait ends, and a batch formed while the model is busy waits
whole for its turn: under steady load each holds only the requests of one wait, and the model runs small
batches (bench/README.md). So each batch Serve forms goes to a `BatchMerger` at once, which sends the scorer
one `decide_batch` over every request that has come while the calls before it ran (up to `max_batch_size`),
`batches_in_flight` (2) at a time, so that the next batch already waits in the scorer when it ends one.
The model runs in a child process of the replica (core/decision/process.py: on a thread, the replica's event
loop and the model took turns on one GIL), or with `decision_process: false` on a worker thread of it.
"""
from __future__ import annotations

import asyncio
import collections
import logging

from ray import serve
from ray.serve.metrics import Counter, Gauge, Histogram

import msgspec

from core.decision.process import start_scorer
from core.decision.protocol import (Decided, DecisionModelInfo, DecisionRefused, DecisionRequest,
                                    DecisionValidationError, ScorerStart)

from .gauges import kept
from .settings import BatchSettings, DecisionSettings, checkpoint_time

BATCH = BatchSettings()

logger = logging.getLogger(__name__)


class BatchMerger:
    """Runs `run(items) -> results` with at most `depth` calls in flight; items submitted while they run go
    together into the next call, up to `max_size` (a submission is never split; one larger than max_size runs
    alone). With a depth of 2 the scorer, which runs its calls in order, always has the next batch waiting when
    one ends, instead of idling for a round trip through this event loop between batches; the batches stay as
    large, since a call starts only once one ends."""

    def __init__(self, run, max_size: int, depth: int = 2):
        self.run, self.max_size, self.depth = run, max_size, depth
        self._pending: list[tuple[list, list[asyncio.Future]]] = []
        self._running = 0
        self._soon = False

    def submit(self, items: list) -> list[asyncio.Future]:
        """A future of each item's result (or of the call's exception). Calls start on the loop's next turn,
        so what is submitted in one turn goes together."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in items]
        self._pending.append((list(items), futures))
        if not self._soon:
            self._soon = True
            loop.call_soon(self._start, loop)
        return futures

    def _start(self, loop) -> None:
        self._soon = False
        while self._pending and self._running < self.depth:
            items, futures = [], []
            while self._pending and (not items or len(items) + len(self._pending[0][0]) <= self.max_size):
                more, their = self._pending.pop(0)
                live = [(x, f) for x, f in zip(more, their) if not f.done()]     # a caller gone: not run
                items += [x for x, _ in live]
                futures += [f for _, f in live]
            if items:
                self._running += 1
                loop.create_task(self._call(items, futures))

    async def _call(self, items: list, futures: list[asyncio.Future]) -> None:
        try:
            results = await self.run(items)
        except Exception as e:
            for f in futures:
                if not f.done():
                    f.set_exception(e)
        else:
            for f, r in zip(futures, results):
                if not f.done():
                    f.set_result(r)
        finally:
            self._running -= 1
            self._start(asyncio.get_running_loop())


@serve.deployment(name="DecisionModel")
class DecisionModel:
    def __init__(self, settings: DecisionSettings):
        """settings: the decision part of AppArgs; its `scorer` record goes to the scorer whole."""
        # torch_threads None: Ray's OMP_NUM_THREADS (the replica's whole CPUs, at least 1), which the child inherits
        start = ScorerStart(settings.checkpoint, settings.scorer, settings.device, settings.torch_threads)
        self.scorer = start_scorer(start, settings.process)
        self.name, self.aliases = settings.name, list(settings.model_aliases)
        self.batch_sizes: collections.Counter[int] = collections.Counter()   # batch size -> how many batches
        self.batch_size_metric = Histogram("decision_batch_size", "Requests per decision batch.",
                                           [1, 2, 4, 8, 16, 32, 64, 128], tag_keys=("model",))
        self.questions_metric = Counter("decision_questions_total", "Questions scored.", tag_keys=("model",))
        self.prefix_queries_metric = Counter("decision_prefix_cache_queries_total",
                                             "Prefix tokens looked up in the prefix cache.", tag_keys=("model",))
        self.prefix_hits_metric = Counter("decision_prefix_cache_hits_total",
                                          "Prefix tokens found in the prefix cache.", tag_keys=("model",))
        self.prefix_bytes_metric = Gauge("decision_prefix_cache_bytes", "Bytes of prefix states held.",
                                         tag_keys=("model",))
        self._reported = {"query_tokens": 0, "hit_tokens": 0}
        self.merger = BatchMerger(self._run, BATCH.max_batch_size, BATCH.batches_in_flight)
        for m in (self.batch_size_metric, self.questions_metric, self.prefix_queries_metric, self.prefix_hits_metric,
                  self.prefix_bytes_metric):
            m.set_default_tags({"model": self.name})   # a fresh dict each: Serve mutates it
        kept(self.prefix_bytes_metric).set(self.scorer.prefix_stats().bytes)   # a series before the first batch
        logger.info("decision model loaded (%s, %s)", type(self.scorer).__name__, self.scorer.info)

    def reconfigure(self, user_config: dict) -> None:
        batch = BatchSettings.model_validate(user_config or {})
        self._batched.set_max_batch_size(batch.max_batch_size)
        self.merger.max_size, self.merger.depth = batch.max_batch_size, batch.batches_in_flight
        self._batched.set_batch_wait_timeout_s(batch.batch_wait_timeout_s)

    def info(self) -> DecisionModelInfo:
        return DecisionModelInfo(self.name, checkpoint_time(self.scorer.info.path), tuple(self.aliases),
                                 self.scorer.info.template)

    def stats(self) -> dict:
        return {"batches": sum(self.batch_sizes.values()), "largest_batch": max(self.batch_sizes, default=0),
                "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                "scorer": type(self.scorer).__name__, "prefix_cache": msgspec.to_builtins(self.scorer.prefix_stats()),
                "memory": self.scorer.memory}

    def check_health(self) -> None:
        if not self.scorer.alive():
            raise RuntimeError("the decision process has stopped")

    async def decide(self, request: bytes | DecisionRequest) -> bytes | DecisionRefused:
        """A parsed request (the Ingress's DecisionRequest.check, as `to_bytes` made it) -> its answer's JSON
        body as the client gets it, or why it is refused."""
        return await (await self._batched(DecisionRequest.of(request)))

    @serve.batch(max_batch_size=BATCH.max_batch_size, batch_wait_timeout_s=BATCH.batch_wait_timeout_s)
    async def _batched(self, requests: list[DecisionRequest]) -> list[asyncio.Future]:
        """Serve's batch, handed on at once (so the next one can form): a future of each request's answer."""
        return self.merger.submit(requests)

    async def _run(self, requests: list[DecisionRequest]) -> list[bytes | DecisionRefused]:
        """One decide_batch over the merged requests."""
        self.batch_sizes[len(requests)] += 1
        self.batch_size_metric.observe(len(requests))
        try:
            return self._answers(await self.scorer.decide_batch(requests))
        finally:
            self._report_prefix_cache()

    def _report_prefix_cache(self) -> None:
        stats = self.scorer.prefix_stats()
        for key, metric in (("query_tokens", self.prefix_queries_metric), ("hit_tokens", self.prefix_hits_metric)):
            value = getattr(stats, key)
            if value > self._reported[key]:
                metric.inc(value - self._reported[key])
                self._reported[key] = value
        kept(self.prefix_bytes_metric).set(stats.bytes)

    def _answers(self, results: list) -> list[bytes | DecisionRefused]:
        out: list[bytes | DecisionRefused] = []
        for res in results:
            if isinstance(res, DecisionValidationError):
                out.append(DecisionRefused(res.errors))
            else:
                answers, usage = res
                self.questions_metric.inc(len(answers))
                out.append(Decided(self.name, answers, usage).wire_bytes())
        return out

    def __del__(self):
        scorer = getattr(self, "scorer", None)
        if scorer is not None:
            scorer.shutdown()
