"""The decision scorer behind a client: on a worker thread of the caller's process, or in a child process.

A decision pass is thousands of small torch operations, each of which hands the GIL over and takes it back.
On a thread of a serving replica, every wake-up of the replica's event loop (requests arriving, Serve's
gRPC, metrics) takes the GIL in between, which slows the passes severalfold and keeps the service's batches
small (bench/README.md has the measurement). `ProcessScorer` runs the scorer in
a child process of its own, as the chat engine runs (core/chat/engine_process.py), and talks to it over a
private socket pair (core/child.py):

    parent -> child   ScorerStart once, then Decide | Stop
    child -> parent   ScorerReady | Failed once, then Done | Crashed (one per Decide)

Each Done carries the results of one `decide_batch` (answers and usage, or a request's
DecisionValidationError) and the prefix cache's counters. If the parent dies, the socket closes and the child
exits; the parent stops the child by its pid. `ThreadScorer` keeps the scorer in this process (tests,
notebooks, `decision_process: false`).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import traceback
from multiprocessing.connection import Connection

from ..child import ChildClient, Failed, Stop, child_main
from .memory import MemoryReturn
from .protocol import Crashed, Decide, DecisionRequest, Done, PrefixStats, ScorerInfo, ScorerReady, ScorerStart

logger = logging.getLogger(__name__)


class ScorerDied(RuntimeError):
    """The decision process is gone; the replica reports itself unhealthy and Serve replaces it."""


def scorer_info(scorer) -> ScorerInfo:
    """What the deployment and its tests read of a scorer, wherever it runs (the synthetic one imports no torch)."""
    torch = sys.modules.get("torch")
    return ScorerInfo(scorer.path, str(scorer.device), dict(scorer.kernels), scorer.max_length, scorer.max_batch_tokens,
                      scorer.config.graphs, scorer.prefix_cache.capacity_bytes,
                      torch.get_num_threads() if torch else None, os.getpid(), dict(scorer.template))


def prefix_stats(scorer) -> PrefixStats:
    return PrefixStats(**scorer.prefix_cache.stats())


def build_scorer(start: ScorerStart):
    if start.config.backend == "synthetic":
        from .synthetic import SyntheticScorer
        return SyntheticScorer(start.checkpoint, start.config)
    import torch

    from .scorer import StartLuxDecision

    if start.torch_threads:
        torch.set_num_threads(start.torch_threads)
    return StartLuxDecision(start.checkpoint, start.config, device=start.device)


def run_batch(scorer, requests: list[DecisionRequest]) -> list:
    return scorer.decide_requests(requests)


class ThreadScorer:
    """The scorer in this process; each batch runs on a worker thread, off the event loop."""

    def __init__(self, start: ScorerStart):
        self.scorer = build_scorer(start)
        self.info = scorer_info(self.scorer)
        self.memory: dict = {}     # the caller's process: its memory is the caller's business

    async def decide_batch(self, requests: list[DecisionRequest]) -> list:
        return await asyncio.to_thread(run_batch, self.scorer, requests)

    def prefix_stats(self) -> PrefixStats:
        return prefix_stats(self.scorer)

    def alive(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


class ProcessScorer(ChildClient):
    """The scorer in a child process. `decide_batch` is awaited on the caller's loop; the reader thread hands
    each Done to the call that waits for it. Calls may overlap (each has its id); the child runs them in order."""

    logger = logger

    def __init__(self, start: ScorerStart, start_timeout_s: float = 600.0):
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._ids = itertools.count()
        self.memory: dict = {}
        self._start_child("core.decision.process", "the decision process", start, ScorerReady, start_timeout_s,
                          "decision-reader")
        self.info, self._prefix_stats = self.child.ready.info, self.child.ready.prefix_stats

    async def decide_batch(self, requests: list[DecisionRequest]) -> list:
        """Parsed requests -> per request (answers, Usage) or its DecisionValidationError."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        call = next(self._ids)
        self._calls[call] = (loop, future)          # before the send: the answer may come at once
        try:
            self.child.send(Decide(call, list(requests)), ScorerDied)
        except ScorerDied:
            self._calls.pop(call, None)
            raise
        return await future

    def _receive(self, msg) -> None:
        match msg:
            case Done(call, results, stats, memory):
                self._prefix_stats, self.memory = stats, memory
                self._resolve(call, results=results)
            case Crashed(call, message):
                self._resolve(call, error=RuntimeError(f"the decision model failed:\n{message}"))

    def _ended(self) -> None:
        for call in list(self._calls):             # a call registered after this: its send raises ScorerDied
            self._resolve(call, error=ScorerDied("the decision process stopped"))

    def _resolve(self, call: int, results=None, error: BaseException | None = None) -> None:
        target = self._calls.pop(call, None)
        if target is None:
            return
        loop, future = target

        def settle():
            if future.done():                      # its caller was cancelled meanwhile
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(results)
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:                       # that loop has closed
            pass

    def prefix_stats(self) -> PrefixStats:
        return self._prefix_stats


def start_scorer(start: ScorerStart, process: bool = True):
    """The scorer `start` describes, behind its client: in a child process or on a thread of this one."""
    return ProcessScorer(start) if process else ThreadScorer(start)


# ---- the child side
def serve_scorer(conn: Connection) -> None:
    start = conn.recv()
    assert isinstance(start, ScorerStart), start
    try:
        scorer = build_scorer(start)
    except Exception:
        conn.send(Failed(traceback.format_exc()))
        return
    conn.send(ScorerReady(scorer_info(scorer), prefix_stats(scorer)))
    memory = MemoryReturn(start.return_memory_s)
    while True:
        match conn.recv():                 # EOFError when the parent is gone: the process ends
            case Decide(call, requests):
                try:
                    results = run_batch(scorer, requests)
                except Exception:          # a fault in the model fails this batch, never the process
                    logger.exception("decision batch failed")
                    conn.send(Crashed(call, traceback.format_exc(limit=5)))
                    continue
                conn.send(Done(call, results, prefix_stats(scorer), memory.report()))
                if not conn.poll():        # between batches, with none waiting
                    memory.maybe()
            case Stop():
                return


def main(argv: list[str]) -> int:
    return child_main(argv, serve_scorer, "decision")


if __name__ == "__main__":
    # run as `python -m core.decision.process`: the records must be the importable module's, not __main__'s
    from core.decision.process import main as module_main
    sys.exit(module_main(sys.argv[1:]))
