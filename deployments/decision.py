"""The decision deployment: one StartLuxDecision per replica, requests batched with @serve.batch.

Concurrent requests are collected into the scorer's `decide_batch` (which sends a batch of one through
`decide`, so on a GPU it replays a CUDA graph). `max_batch_size` and `batch_wait_timeout_s` are live settings
(`user_config` -> `reconfigure`, BatchSettings); the deployment's `max_ongoing_requests` must be at least the
batch size or batches could never fill. The model runs on a worker thread, off the event loop.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter as Tally

import torch
from ray import serve
from ray.serve.metrics import Counter, Gauge, Histogram

from core.decision import DecisionValidationError, StartLuxDecision

from .errors import error
from .settings import BatchSettings, DecisionSettings, checkpoint_time

BATCH = BatchSettings()

logger = logging.getLogger(__name__)


def validation_error(e: DecisionValidationError) -> dict:
    """One error naming every bad question key; `errors` maps each key to its reason."""
    keys = ", ".join(f"{k!r}" for k in e.errors)
    body = error(f"invalid questions ({keys}): {e}", param=next(iter(e.errors), None))
    body["error"]["errors"] = e.errors
    return body


@serve.deployment(name="DecisionModel")
class DecisionModel:
    def __init__(self, settings: DecisionSettings):
        """settings: the decision part of AppArgs; its `scorer` record goes to the scorer whole."""
        if settings.torch_threads:   # Ray sets OMP_NUM_THREADS to the replica's whole CPUs (at least 1) otherwise
            torch.set_num_threads(settings.torch_threads)
        self.scorer = StartLuxDecision(settings.checkpoint, settings.scorer, device=settings.device)
        self.name, self.aliases = settings.model_name, list(settings.model_aliases)
        self.batch_sizes: Tally = Tally()
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
        for m in (self.batch_size_metric, self.questions_metric, self.prefix_queries_metric, self.prefix_hits_metric,
                  self.prefix_bytes_metric):
            m.set_default_tags({"model": self.name})   # a fresh dict each: Serve mutates it
        logger.info("decision model loaded on %s (kernels: %s)", self.scorer.device, self.scorer.kernels)

    def reconfigure(self, user_config: dict) -> None:
        batch = BatchSettings.model_validate(user_config or {})
        self._batched.set_max_batch_size(batch.max_batch_size)
        self._batched.set_batch_wait_timeout_s(batch.batch_wait_timeout_s)

    def info(self) -> dict:
        return {"id": self.name, "created": checkpoint_time(self.scorer.path), "aliases": self.aliases,
                "max_length": self.scorer.max_length,
                "torch_threads": torch.get_num_threads()}

    def stats(self) -> dict:
        return {"batches": sum(self.batch_sizes.values()), "largest_batch": max(self.batch_sizes, default=0),
                "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                "prefix_cache": self.scorer.prefix_cache.stats()}

    async def decide(self, request: dict) -> dict:
        """{"state", "questions"} -> {"model", "answers", "usage"} or {"error": ...}."""
        return await self._batched(request)

    @serve.batch(max_batch_size=BATCH.max_batch_size, batch_wait_timeout_s=BATCH.batch_wait_timeout_s)
    async def _batched(self, requests: list[dict]) -> list[dict]:
        self.batch_sizes[len(requests)] += 1
        self.batch_size_metric.observe(len(requests))
        try:
            return await asyncio.to_thread(self._run, requests)
        finally:
            self._report_prefix_cache()

    def _report_prefix_cache(self) -> None:
        stats = self.scorer.prefix_cache.stats()
        for key, metric in (("query_tokens", self.prefix_queries_metric), ("hit_tokens", self.prefix_hits_metric)):
            if stats[key] > self._reported[key]:
                metric.inc(stats[key] - self._reported[key])
                self._reported[key] = stats[key]
        self.prefix_bytes_metric.set(stats["bytes"])

    def _run(self, requests: list[dict]) -> list[dict]:
        results = self.scorer.decide_batch([(r.get("state"), r.get("questions")) for r in requests],
                                           with_usage=True, return_exceptions=True)
        out = []
        for res in results:
            if isinstance(res, DecisionValidationError):
                out.append(validation_error(res))
            else:
                answers, usage = res
                self.questions_metric.inc(len(answers))
                out.append({"model": self.name, "answers": answers, "usage": usage})
        return out
