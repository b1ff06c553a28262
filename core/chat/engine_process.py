"""The chat engine in a child process: the model steps there, the caller's event loop only moves messages.

In one process, the engine thread and the serving event loop take turns on one GIL: a forward pass of a
small model is mostly Python and operator dispatch, every operator hands the GIL over, and the loop's
streaming work then delays the step (and the step delays the loop); on a small CPU host that makes the
chat replica the service's bottleneck (bench/README.md). `ProcessEngine`
runs `LLMEngine` in a child process of its own, as vLLM's engine core does, and talks to it over a private
socket pair (core/child.py):

    parent -> child   EngineStart once, then Add | Abort | Stop
    child -> parent   EngineReady | Failed once, then events | Rejected | Stats

(the records of protocol.py; each side matches on their types). The events of a step travel as msgpack
(protocol.encode_events, several times faster than pickle: bench/README.md), everything else
pickled. One events message carries every event of a step (the first tokens of new prompts go in an earlier
one, before the step's decode pass). The child validates requests (a refusal comes back as Rejected and is
raised from the caller's `generate`), sends its stats while it has work, and exits on Stop or when the socket
closes: if the parent dies, so does the engine. The parent stops the child by its pid.
"""
from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from multiprocessing.connection import Connection

from ..child import ChildClient, Failed, Stop, child_main
from .async_engine import STATS_PERIOD_S, ThreadEngine, EngineClient, StreamHold
from .protocol import (Abort, Add, EngineDied, EngineError, EngineFull, EngineReady, EngineStart, EngineStats,
                       Rejected, SamplingError, SamplingParams, Stats, decode_events, encode_events)

logger = logging.getLogger(__name__)


def build_engine(start: EngineStart):
    """The engine `start` describes, built in the calling process (torch threads set, weights loaded), or the
    synthetic engine (synthetic.py: the checkpoint's tokenizer, no model, no torch)."""
    if start.config.backend == "synthetic":
        from .checkpoint import load_chat_tokenizer
        from .synthetic import SyntheticEngine

        tok, cfg = load_chat_tokenizer(start.checkpoint)
        return SyntheticEngine(tok, cfg.sequence_len, cfg.vocab_size, start.config)
    import torch

    from .engine import LLMEngine
    from .weights import chat_dtype, default_device, load_chat_model

    if start.config.torch_threads:
        torch.set_num_threads(start.config.torch_threads)
    device = torch.device(start.device) if start.device else default_device()
    dtype, why = chat_dtype(start.config.dtype, device)
    model, tok, _ = load_chat_model(start.checkpoint, device, dtype)
    logger.info("chat model in %s (%s)", str(dtype).removeprefix("torch."), why)
    engine = LLMEngine(model, tok, start.config, prefix_ids=list(start.prefix_ids) or None)
    if engine.attention_threads:
        logger.info("attention on %d torch threads, the rest of the model on %d", engine.attention_threads,
                    torch.get_num_threads())
    engine.grammars.tokenizer()       # structured outputs' vocabulary index, before the first request needs it
    return engine


def torch_threads() -> int:
    """torch's intra-op threads in this process; 0 when it has not imported torch (the synthetic engine)."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else 0


def set_cpu_policy(policy: str) -> str:
    """Lower this process's claim on the CPU; -> the policy in force.

    "idle" puts every thread of the process under Linux's SCHED_IDLE (threads started later inherit it): the
    engine then gets a core only when no thread of normal priority wants it, and gives it up as soon as one
    wakes. On a CPU host where the engine shares a few cores with the serving processes, this lets the event
    loops that relay streams, HAProxy and the router run the moment their socket is ready instead of queueing
    behind a decode pass (bench/README.md: run-queue waits and time to first token). Without SCHED_IDLE
    (not Linux) it falls back to nice 19; if the system refuses, the engine keeps the usual policy and says so
    in its log. Not for GPU hosts: there the engine's CPU time launches kernels."""
    if policy == "normal":
        return "normal"
    try:
        if not hasattr(os, "SCHED_IDLE"):
            os.nice(19)
            return "nice 19"
        param = os.sched_param(0)
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, param)
            except ProcessLookupError:              # a thread that ended meanwhile
                pass
    except OSError as e:                            # e.g. a sandbox that forbids it: serve anyway
        logger.warning("could not lower the engine's CPU priority (%s); it keeps the usual policy", e)
        return f"normal ({policy} refused: {e})"
    return "idle"


def start_engine(start: EngineStart, on_stats=None, hold: StreamHold | None = None) -> EngineClient:
    """The engine `start` describes, behind its client: in a child process (ProcessEngine) or, with
    `config.process` off, on a thread of this process (ThreadEngine). `hold`: when the client wakes a stream."""
    if start.config.process:
        return ProcessEngine(start, on_stats=on_stats, hold=hold)
    return ThreadEngine(build_engine(start), on_stats=on_stats, hold=hold)


class ProcessEngine(ChildClient, EngineClient):
    raw = staticmethod(decode_events)          # one step's events come as msgpack (see serve_engine)
    logger = logger

    def __init__(self, start: EngineStart, on_stats=None, start_timeout_s: float = 600.0,
                 hold: StreamHold | None = None):
        EngineClient.__init__(self, on_stats, hold)
        self.start = start
        self.max_rows = start.config.max_rows
        self._stats = EngineStats(0, 0, 0, start.config.max_rows, 0, 0)
        self._start_child("core.chat.engine_process", "the chat engine process", start, EngineReady, start_timeout_s,
                          "chat-engine-reader")
        self.info = self.child.ready

    def _receive(self, msg) -> None:
        """On the reader thread (which blocks on the socket without the GIL): route what the child sends."""
        match msg:
            case list():                            # one step's events
                self._deliver(msg)
            case Rejected(rid, error):
                self._fail([rid], error)
            case Stats(stats):
                self._stats = stats
                if self.on_stats is not None:
                    self.on_stats(stats)

    def _ended(self) -> None:
        for rid in list(self._queues):              # one exception per request: each is raised in its own task
            self._fail([rid], EngineDied("the chat engine process stopped"))

    def _submit(self, prompt: list[int], params: SamplingParams, rid: str, resume: list[int] | None) -> None:
        self.child.send(Add(rid, list(prompt), params, tuple(resume or ())), EngineDied)

    def _cancel(self, rid: str) -> None:
        try:
            self.child.send(Abort(rid), EngineDied)
        except EngineDied:
            pass

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def linear(self) -> str:
        return self.info.linear

    @property
    def attention(self) -> str:
        return self.info.attention

    @property
    def dtype(self) -> str:
        return self.info.dtype

    @property
    def decode(self) -> str:
        return self.info.decode

    def alive(self) -> bool:
        return ChildClient.alive(self)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        ChildClient.shutdown(self, timeout_s)


# ---- the child side
def serve_engine(conn: Connection) -> None:
    """The child's main loop: build the engine from EngineStart, then take requests and step until told to stop."""
    start = conn.recv()
    assert isinstance(start, EngineStart), start
    try:
        policy = set_cpu_policy(start.config.cpu_policy)   # before the build, so torch's threads inherit it
        engine = build_engine(start)
    except Exception:
        conn.send(Failed(traceback.format_exc()))
        return
    conn.send(EngineReady(str(engine.device), os.getpid(), torch_threads(), policy, engine.linear, engine.attention,
                          engine.dtype, engine.decode))

    def emit(events) -> None:
        conn.send_bytes(encode_events(events))     # msgpack: a few times cheaper than pickling the events

    stats_at = 0.0
    while True:
        if not engine.has_work():
            if stats_at:                            # the last word after a busy spell: idle stats
                conn.send(Stats(engine.stats()))
                stats_at = 0.0
            conn.poll(None)                         # sleep until the parent sends something (or goes away)
        while conn.poll(0):
            match conn.recv():                      # EOFError when the parent is gone: the process ends
                case Add(rid, prompt, params, resume):
                    try:
                        engine.add_request(prompt, params, rid, list(resume))
                    except (EngineError, EngineFull, SamplingError) as e:
                        conn.send(Rejected(rid, e))
                case Abort(rid):
                    engine.abort(rid)
                case Stop():
                    return
        if not engine.has_work():
            continue
        try:
            events = engine.step(emit=emit)
        except Exception:   # a fault in the model ends every request, never the process
            logger.exception("engine step failed; ending every request")
            events = engine.fail_all("error")
        if events:
            emit(events)
        now = time.monotonic()
        if now - stats_at >= STATS_PERIOD_S:
            conn.send(Stats(engine.stats()))
            stats_at = now


def main(argv: list[str]) -> int:
    return child_main(argv, serve_engine, "chat-engine")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
