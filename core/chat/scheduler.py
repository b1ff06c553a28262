"""The scheduling side of the chat engine: queues, admission, the row pool, retirement. No torch, no model.

A request waits in arrival order (FIFO, so nobody starves) until enough rows are free for its `n` samples;
its first sample's row then starts with the longest cached prefix of its prompt (prefix_index.py): a free row
holding it is taken over as it is, else the engine copies the prefix in (`Admitted.copy_from`). Prompts
prefill up to `prefill_chunk` tokens a step (several short ones together, a long one a chunk per step, so
running streams keep flowing); every running sample decodes one token a step. Finished samples give their
rows back, with the tokens those rows hold, for later prompts to reuse.

`add` and `abort` may be called from another thread than the one that steps; everything else runs on the
stepping thread.
"""
from __future__ import annotations

import random
import threading
from collections import deque
from dataclasses import dataclass, field

import msgspec

from .outputs import SampleOutput
from .prefix_index import BLOCK, RowPool
from .protocol import EngineConfig, EngineFull, EngineError, SamplingError, SamplingParams


DEFER_MIN = 64       # tokens a waiting prompt must share with one being prefilled to wait for it (admit)


def row_rng(seed: int | None, sample_index: int) -> random.Random:
    """The random stream of one sample: reproducible for a seed, fresh entropy otherwise."""
    if seed is None:
        return random.Random()
    return random.Random(f"{seed}:{sample_index}")


def check_request(prompt: list[int], params: SamplingParams, sequence_len: int, vocab_size: int,
                  max_rows: int) -> int:
    """What an engine refuses in a new request (EngineError, SamplingError); -> the tokens it may generate
    (max_tokens, cut to the context)."""
    if not prompt:
        raise EngineError("the prompt is empty")
    if len(prompt) >= sequence_len:
        raise EngineError(f"the prompt has {len(prompt)} tokens; the model's context is {sequence_len}")
    if params.n > max_rows:
        raise EngineError(f"n={params.n} exceeds the {max_rows} sequences this engine runs at once")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise EngineError(f"prompt token ids must be in [0, {vocab_size})")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise SamplingError(f"logit_bias token ids must be in [0, {vocab_size})", "logit_bias")
    return min(params.max_tokens, sequence_len - len(prompt))


def check_resume(resume: list[int], params: SamplingParams, max_new: int, vocab_size: int,
                 stop_tokens: frozenset[int]) -> None:
    """What an engine refuses in the tokens a request continues from."""
    if params.n != 1:
        raise EngineError("only a request with n=1 can continue an earlier generation")
    if len(resume) >= max_new:
        raise EngineError(f"the generation continued from has {len(resume)} tokens; nothing is left of the "
                          f"{max_new} it may have")
    if min(resume) < 0 or max(resume) >= vocab_size:
        raise EngineError("continued token ids must be in the vocabulary")
    if not params.ignore_eos and stop_tokens & set(resume):
        raise EngineError("the generation continued from has already ended")


def new_request(rid: str, prompt: list[int], params: SamplingParams, resume: list[int] | None, sequence_len: int,
                vocab_size: int, max_rows: int, outputs) -> "Request":
    """A request as an engine's add_request takes it, checked (check_request, check_resume): its samples, each
    with its random stream and output state (`outputs`: the engine's OutputProcessor). A continued run does not
    score its prompt again: the run it continues delivered that."""
    max_new = check_request(prompt, params, sequence_len, vocab_size, max_rows)
    if resume:
        check_resume(resume, params, max_new, vocab_size, outputs.stop_tokens)
        if params.prompt_logprobs is not None:
            params = msgspec.structs.replace(params, prompt_logprobs=None)
    samples = [Sample(row_rng(params.seed, i), outputs.new_sample(i)) for i in range(params.n)]
    return Request(rid, list(prompt), params, max_new, samples, list(resume or []))


@dataclass
class Sample:
    """One of a request's samples: its row and place in the KV cache, its random stream, its output state."""

    rng: random.Random
    output: SampleOutput
    row: int = -1
    position: int = 0               # tokens of this row already in the cache
    pending: int | None = None      # last token, not yet fed to the model
    matcher: object | None = None   # structured output: the sample's grammar matcher (constrained.py)

    @property
    def finished(self) -> bool:
        return self.output.finish_reason is not None


@dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    max_new: int                    # tokens it may generate: max_tokens, cut to the context
    samples: list[Sample]
    resume: list[int] = field(default_factory=list)   # tokens already generated, continued from (n == 1)
    prefilled: int = 0              # tokens of `feed` in the first sample's row
    cached_tokens: int = 0          # prompt tokens reused from the prefix cache, not computed
    prompt_entries: list | None = None   # with prompt_logprobs: the prompt's entries so far (prompt_memo's form)
    scored: list | None = None      # the finished entries, until the first sample's first event carries them

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.samples)

    @property
    def feed(self) -> list[int]:
        """What the first sample's row is prefilled with: the prompt, then the tokens continued from."""
        return self.prompt + self.resume if self.resume else self.prompt

    def token_at(self, s: Sample, i: int) -> int:
        """The token at position i of sample `s`'s sequence (the prompt, then what it generated); -1 before 0."""
        if i < 0:
            return -1
        return self.prompt[i] if i < len(self.prompt) else s.output.generated[i - len(self.prompt)]

    def fed(self, s: Sample) -> list[int]:
        """The tokens whose keys and values sample `s`'s row holds: what was fed into it (the last sampled token
        never was). A sample whose prompt was still prefilling holds the prefilled part if it is the first."""
        if s.position:
            return (self.prompt + s.output.generated)[:s.position]
        return self.feed[:self.prefilled] if s is self.samples[0] else []


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request that got its rows this step; `copy_from` (row, tokens) when its first row needs a prefix copied
    in from a row that keeps it."""

    request: Request
    copy_from: tuple[int, int] | None


class Scheduler:
    """`prompt_memo` keeps, per KV-cache row, the prompt logprobs computed when a request that asked for them
    prefilled it: (how many alternatives, [(token, logprob, top) per position]). A later request that asks
    for them may reuse that row's prefix only as far as the memo covers it, and then one position less, so the
    logits that score its first new token are computed (they are not kept)."""

    def __init__(self, config: EngineConfig):
        self.max_rows, self.max_waiting = config.max_rows, config.max_waiting
        self.prefill_chunk = max(1, config.prefill_chunk)
        self.prefix_caching = config.prefix_caching
        self.pool = RowPool(config.max_rows)
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._inbox: deque[Request] = deque()
        self._aborts: set[str] = set()
        self._lock = threading.Lock()
        self.prompt_memo: dict[int, tuple[int, list]] = {}

    # ---- from any thread
    def add(self, req: Request) -> None:
        with self._lock:
            if req.id in self.requests:
                raise EngineError(f"request id {req.id!r} is already in use")
            if len(self.waiting) + len(self._inbox) >= self.max_waiting:
                raise EngineFull(f"{self.max_waiting} requests are already waiting")
            self.requests[req.id] = req
            self._inbox.append(req)

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self.requests:
                self._aborts.add(request_id)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.requests)

    def counts(self) -> tuple[int, int, int]:
        """(running, waiting, cache positions in use)."""
        with self._lock:
            waiting = len(self.waiting) + len(self._inbox)
            active = [s for r in self.prefilling + self.running for s in r.samples if s.row >= 0]
        return len(self.prefilling) + len(self.running), waiting, sum(s.position for s in active)

    # ---- one step, on the stepping thread
    def collect(self) -> list[Request]:
        """Take in what arrived since the last step; -> the requests aborted meanwhile that have not finished
        (they leave the waiting queue; the caller ends their samples)."""
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            while self._inbox:
                self.waiting.append(self._inbox.popleft())
        out = []
        for rid in aborts:
            req = self.requests.get(rid)
            if req is None or req.done:
                continue
            if req in self.waiting:
                self.waiting.remove(req)
            out.append(req)
        return out

    def admit(self) -> list[Admitted]:
        """Rows for waiting requests, in arrival order, while enough are free. At least the last prompt token is
        always computed (its logits are sampled from), so a cached prefix covers at most all but one.

        With prefix caching, a prompt that shares at least DEFER_MIN more tokens with a prompt being prefilled (or
        admitted in this call) than the cache holds waits, ahead of later arrivals, until that prompt is in its
        row: then it copies the shared part instead of computing it again, and its decode reads those keys
        together with the rows that hold the same copy (attention.py). A burst of requests with one system
        prompt computes it once."""
        out: list[Admitted] = []
        deferred: list[Request] = []
        while self.waiting and self.pool.n_free >= self.waiting[0].params.n:
            req = self.waiting.popleft()
            feed = req.feed
            if self.prefix_caching and req.params.prompt_logprobs is None:
                pending = self._pending_overlap(feed, self.prefilling + [a.request for a in out])
                if pending >= DEFER_MIN and pending >= self.pool.match(feed, len(feed) - 1, count=False).length \
                        + DEFER_MIN:
                    deferred.append(req)
                    continue
            m = self.pool.match(feed, limit=len(feed) - 1)
            length = m.length
            if req.params.prompt_logprobs is not None:
                length = self._scored_reuse(req, m.row, length)
                self.pool.hit_tokens -= m.length - length
            first = req.samples[0]
            copy = None
            if length and m.free:
                self.pool.take(m.row)
                first.row = m.row
            else:
                first.row = self.pool.allocate()
                if length:
                    copy = (m.row, length)
            for s in req.samples[1:]:
                s.row = self.pool.allocate()
            for s in req.samples:                   # what these rows held is being overwritten
                self.prompt_memo.pop(s.row, None)
            req.prefilled, req.cached_tokens = length, min(length, len(req.prompt))
            out.append(Admitted(req, copy))
        self.waiting.extendleft(reversed(deferred))
        return out

    @staticmethod
    def _pending_overlap(feed: list[int], pending: list[Request]) -> int:
        """The most leading tokens `feed` shares with any of `pending`'s feeds (at most all but its last)."""
        best = 0
        for other in pending:
            f = other.feed
            lo, hi = 0, min(len(f), len(feed) - 1)
            if hi <= best or f[:BLOCK] != feed[:BLOCK]:
                continue
            while lo < hi:                       # the longest common prefix, by halving (slices compare in C)
                mid = (lo + hi + 1) // 2
                if f[:mid] == feed[:mid]:
                    lo = mid
                else:
                    hi = mid - 1
            best = max(best, lo)
        return best

    def _scored_reuse(self, req: Request, row: int, length: int) -> int:
        """How much of `row`'s matched prefix a request that asks for prompt logprobs may reuse (it takes the
        memo's entries for those positions)."""
        memo = self.prompt_memo.get(row) if length else None
        if memo is None or memo[0] < req.params.prompt_logprobs or len(memo[1]) < length:
            req.prompt_entries = [(req.prompt[0], None, None)]
            return 0
        reuse = length - 1
        req.prompt_entries = list(memo[1][:reuse + 1])
        return reuse

    def scored(self, req: Request) -> list:
        """`req`'s prompt logprobs are complete: -> them, and the first row remembers them for later prompts."""
        entries, req.prompt_entries = req.prompt_entries, None
        self.prompt_memo[req.samples[0].row] = (req.params.prompt_logprobs, entries)
        return entries

    def start_prefill(self, req: Request) -> None:
        self.prefilling.append(req)

    def start_running(self, req: Request) -> None:
        """A request that goes straight to decoding (or that ended while admitted: retire frees its rows)."""
        self.running.append(req)

    def prefill_batch(self) -> list[tuple[Request, int]]:
        """(request, prompt tokens to feed it this step), within prefill_chunk tokens in all."""
        budget, batch = self.prefill_chunk, []
        for req in self.prefilling:
            if budget <= 0:
                break
            take = min(budget, len(req.feed) - req.prefilled)
            batch.append((req, take))
            budget -= take
        return batch

    def prefilled(self, req: Request) -> None:
        """`req`'s prompt is in its rows: it decodes from now on, and (with prefix caching) other requests may
        copy its prompt's keys."""
        if self.prefix_caching:
            self.pool.hold(req.samples[0].row, req.feed)
        self.prefilling.remove(req)
        self.running.append(req)

    def decoding(self) -> list[tuple[Request, Sample]]:
        """The samples that decode a token this step, in row order. A prompt that finishes prefilling this step
        starts decoding at the next: every sample gets at most one token per step."""
        out = [(r, s) for r in self.running for s in r.samples if not s.finished]
        out.sort(key=lambda rs: rs[1].row)
        return out

    def unfinished(self) -> list[tuple[Request, Sample]]:
        """Every sample of every request not yet finished (to end them all after a fault); the waiting queue is
        emptied."""
        with self._lock:
            while self._inbox:
                self.waiting.append(self._inbox.popleft())
            self._aborts.clear()
        out = [(r, s) for r in list(self.waiting) + self.prefilling + self.running for s in r.samples
               if not s.finished]
        self.waiting.clear()
        return out

    def retire(self) -> None:
        """Free the rows of finished samples (keeping what they hold indexed) and forget finished requests."""
        for req in list(self.prefilling) + list(self.running):
            for s in req.samples:
                if s.finished and s.row >= 0:
                    self.pool.release(s.row, req.fed(s) if self.prefix_caching else [])
                    s.row = -1
            if req.done:
                (self.prefilling if req in self.prefilling else self.running).remove(req)
        with self._lock:
            for rid in [rid for rid, r in self.requests.items() if r.done]:
                del self.requests[rid]
