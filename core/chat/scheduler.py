"""The scheduling side of the chat engine: queues, admission, KV-cache blocks, preemption, retirement. No torch.

A running sample holds a row (its slot for per-sequence state: sampling, penalties, grammar masks; `max_rows` of
them bound the sequences in one step) and a block table per layer group: the KV-cache blocks holding its
positions (block_pool.py; a sliding-window group gives back the blocks its window has left, kv_cache.LayerGroups).
A request waits in arrival order (FIFO, so nobody starves) until rows for its `n` samples are free and the blocks
its prompt needs are available; its first sample's table then starts with the cached blocks that hold the longest
prefix of its prompt (shared, not copied), and the rest of the prompt is computed into new blocks. Prompts
prefill up to `prefill_chunk` tokens a step (several short ones together, a long one a chunk per step, so running
streams keep flowing); every running sample decodes one token a step, taking a new block when it fills one. When
no block is left for that, the most recently admitted running request is preempted: its blocks go back (its full
ones stay cached), it keeps its rows and everything it generated, and it waits at the head of the queue to have
its keys computed again (most of them found in the cache) and go on, with no token lost or changed. A prompt's
n samples share its full blocks; each gets its own copy of the partly filled last one. Finished samples give
their blocks back, cached for later prompts to reuse while memory allows.

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
from .block_pool import SCRATCH, BlockPool, chain
from .protocol import EngineConfig, EngineError, EngineFull, EngineStats, SamplingError, SamplingParams


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
    """One of a request's samples: its row, its block table and place in the KV cache, its random stream, its
    output state."""

    rng: random.Random
    output: SampleOutput
    row: int = -1
    tables: list[list[int]] = field(default_factory=list)   # per layer group: the blocks holding its positions
    digests: list[bytes] = field(default_factory=list)      # its full blocks' digests (block_pool.chain)
    committed: int = 0              # its first blocks registered in the prefix cache (every group)
    behind: list[int] = field(default_factory=list)  # per group: blocks before this one given back (windows)
    position: int = 0               # tokens of this sample already in the cache
    target: int = 0                 # tokens it must have in the cache before it decodes (its prefill's end)
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
    cached_tokens: int = 0          # prompt tokens reused from the prefix cache, not computed
    started: bool = False           # its prompt was prefilled and its samples drew their first tokens
    preempted: bool = False         # waiting to have its samples' keys computed again (it keeps its rows)
    prompt_entries: list | None = None   # with prompt_logprobs: the prompt's entries so far (prompt_memo's form)
    scored: list | None = None      # the finished entries, until the first sample's first event carries them
    reserved: list[int] = field(default_factory=list)   # blocks set aside for the other samples' last prompt block
    digests: list[bytes] | None = None   # its feed's full blocks' digests (computed once, when first looked up)

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

    def tokens(self, s: Sample) -> list[int]:
        """Sample `s`'s sequence: its prompt's prefill feeds `feed`; later, the prompt and what it generated
        (the resumed tokens are replayed into `generated` before the prefill, so the two agree)."""
        return self.prompt + s.output.generated if s.output.generated else self.feed


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request that got its rows and blocks this step (or, preempted earlier, its blocks again); `copy`
    (source, destination): a cached block to copy into the first sample's own block before its prefill, which
    computes that block's last position again (release the sources' hold after the copy), one per layer group."""

    request: Request
    copy: list[tuple[int, int]] | None = None


class Scheduler:
    """`prompt_memo` keeps, per cached block (by its content id), the prompt logprobs computed when a request that
    asked for them prefilled the prompt it ends: (how many alternatives, [(token, logprob, top) per position]),
    covering at least that block. A later request that asks for them reuses a cached prefix only as far as a memo
    covers it, less its last block, so the logits that score its first new token are computed (they are not
    kept)."""

    def __init__(self, config: EngineConfig, n_blocks: int, block_size: int,
                 windows: tuple[int | None, ...] = (None,)):
        """windows: per layer group (kv_cache.LayerGroups), the sliding window of its layers (None: full
        context)."""
        self.max_rows, self.max_waiting = config.max_rows, config.max_waiting
        self.prefill_chunk = max(1, config.prefill_chunk)
        self.prefix_caching = config.prefix_caching
        self.block_size = block_size
        self.windows = tuple(windows)
        self.groups = len(self.windows)
        self.windowed = any(w is not None for w in self.windows)
        self.pool = BlockPool(n_blocks, block_size, on_evict=self._evicted)
        # blocks kept free for running samples' next blocks when admitting (vLLM's watermark)
        self.watermark = max(1, self.pool.usable // 100)
        self.free_rows: set[int] = set(range(config.max_rows))
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._inbox: deque[Request] = deque()
        self._aborts: set[str] = set()
        self._lock = threading.Lock()
        self.prompt_memo: dict[bytes, tuple[int, list]] = {}
        self.preemptions = 0
        self._admitted = 0              # admission order, for choosing whom to preempt
        self._order: dict[str, int] = {}

    def _evicted(self, key: tuple) -> None:
        self.prompt_memo.pop(key[1], None)

    # ---- from any thread
    def add(self, req: Request) -> None:
        self.check_fits(req)
        with self._lock:
            if req.id in self.requests:
                raise EngineError(f"request id {req.id!r} is already in use")
            if len(self.waiting) + len(self._inbox) >= self.max_waiting:
                raise EngineFull(f"{self.max_waiting} requests are already waiting")
            self.requests[req.id] = req
            self._inbox.append(req)

    def check_fits(self, req: Request) -> None:
        """Refuse a request whose samples could not all reach their end in the whole KV cache at once (its full
        prompt blocks shared): preemption could never let it finish."""
        bs, pool, n = self.block_size, self.pool, req.params.n
        longest = pool.blocks_for(len(req.prompt) + req.max_new)
        shared, prompt = len(req.feed) // bs, pool.blocks_for(len(req.feed))
        need = sum(shared + n * (longest - shared) if w is None else prompt + n * min(longest, w // bs + 2)
                   for w in self.windows)
        if need > pool.usable:
            raise EngineError(f"the request needs up to {need * bs} positions of KV cache ({len(req.prompt)} prompt "
                              f"tokens, max_tokens {req.max_new}, n={req.params.n}); the cache holds "
                              f"{pool.usable * bs} (chat_kv_cache_memory): ask for fewer tokens or samples")

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self.requests:
                self._aborts.add(request_id)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.requests)

    def stats(self) -> EngineStats:
        """The engine's EngineStats: rows, blocks, the prefix cache's lookups and hits, preemptions."""
        running, waiting, positions = self.counts()
        pool = self.pool
        capacity = pool.usable // self.groups * pool.block_size
        return EngineStats(running, waiting, self.max_rows - len(self.free_rows), self.max_rows, positions, capacity,
                           pool.query_tokens, pool.hit_tokens, pool.usable, pool.in_use, pool.cached_blocks,
                           pool.block_size, self.preemptions, pool.evictions)

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
                if req.preempted:               # it holds rows: retire gives them back
                    self.running.append(req)
            out.append(req)
        return out

    def admit(self) -> list[Admitted]:
        """Rows and blocks for waiting requests, in arrival order, while enough are free. At least the last prompt
        token is always computed (its logits are sampled from), so cached blocks cover at most all but one.

        With prefix caching, a prompt that shares at least DEFER_MIN more tokens with a prompt being prefilled (or
        admitted in this call) than the cache holds waits, ahead of later arrivals, until that prompt is in its
        blocks: then it shares them instead of computing them again, and its decode reads those keys together
        with the other sequences that list the same blocks (attention.py). A burst of requests with one system
        prompt computes it once."""
        out: list[Admitted] = []
        deferred: list[Request] = []
        bs, pool, G = self.block_size, self.pool, self.groups
        while self.waiting:
            req = self.waiting[0]
            if req.preempted:
                if not self._readmit(req):
                    break
                self.waiting.popleft()
                out.append(Admitted(req))
                continue
            if len(self.free_rows) < req.params.n:
                break
            feed = req.feed
            if req.digests is None:
                req.digests = chain(feed, bs, []) if self.prefix_caching else []
            h, hits = self._hits(req.digests, len(feed) - 1)
            if self.prefix_caching and req.params.prompt_logprobs is None:
                pending = self._pending_overlap(feed, self.prefilling + [a.request for a in out])
                if pending >= DEFER_MIN and pending >= h * bs + DEFER_MIN:
                    deferred.append(self.waiting.popleft())
                    continue
            # a request that asks for prompt logprobs computes the last cached position again (copy on write)
            cow = req.params.prompt_logprobs is not None and self._scored_reuse(req, h, req.digests)
            if req.params.prompt_logprobs is not None and not cow:
                h, hits = 0, [[] for _ in range(G)]
            partial = len(feed) % bs != 0
            blocks = pool.blocks_for(len(feed))
            need = G * (blocks - h + cow + (req.params.n - 1) * partial)
            if not self._room(need, hits):
                break
            self.waiting.popleft()
            if self.prefix_caching:
                pool.query_tokens += len(feed)
                pool.hit_tokens += h * bs - cow
            first = req.samples[0]
            copies = []
            first.tables = []
            for g in range(G):
                pool.take(hits[g])
                shared = hits[g][:-1] if cow else hits[g]
                own = pool.allocate(blocks - len(shared))
                first.tables.append(shared + own)
                if cow:
                    copies.append((hits[g][-1], own[0]))
            first.committed = h - cow
            first.digests = req.digests[:h - cow]
            first.behind = [0] * G
            first.position = h * bs - cow
            first.target = len(feed)
            req.reserved = pool.allocate(G * (req.params.n - 1) * partial) or []
            for s in req.samples:
                s.row = self.free_rows.pop()
            req.cached_tokens = min(first.position, len(req.prompt))
            self._order[req.id] = self._admitted = self._admitted + 1
            out.append(Admitted(req, copies or None))
        self.waiting.extendleft(reversed(deferred))
        return out

    def _hits(self, digests: list[bytes], limit: int) -> tuple[int, list[list[int]]]:
        """The longest prefix of whole blocks (at most `limit` tokens) that the cache holds for every layer group:
        a full-context group must hold all its blocks, a sliding-window group those that the window of the hit's
        last position sees (vLLM's hybrid rule; that position, not the next, since a prompt-logprobs reuse computes
        it again). -> (blocks, per group the table's first entries: the cached blocks, the scratch block before a
        window)."""
        G, bs, pool = self.groups, self.block_size, self.pool
        if not self.prefix_caching:
            return 0, [[] for _ in range(G)]
        full = [g for g, w in enumerate(self.windows) if w is None]
        h, n = 0, min(len(digests), limit // bs)
        while h < n and all(pool.cached(g, digests[h]) is not None for g in full):
            h += 1

        def low(g: int, h: int) -> int:        # the first block a window group needs at a hit of h blocks
            w = self.windows[g]
            return 0 if w is None else max(0, h * bs - 1 - w) // bs

        while h and not all(pool.cached(g, digests[i]) is not None
                            for g in range(G) if self.windows[g] is not None for i in range(low(g, h), h)):
            h -= 1
        return h, [[SCRATCH] * low(g, h) + [pool.cached(g, digests[i]) for i in range(low(g, h), h)]
                   for g in range(G)]

    def _room(self, need: int, hits: list[list[int]]) -> bool:
        """Whether `need` new blocks can be had beside the cached ones hits take out of the free queue (`hits`:
        tables, a block counted once however many list it), keeping the watermark for the running samples (unless
        nothing runs: then everything is there to have)."""
        idle = len({b for t in hits for b in t if b != SCRATCH and self.pool.ref[b] == 0})
        keep = self.watermark if self.running or self.prefilling else 0
        return need + idle <= self.pool.available - keep

    def _readmit(self, req: Request) -> bool:
        """A preempted request's blocks again: each unfinished sample's tables start with the cached blocks of its
        sequence (usually most of what it held) and get new ones for the rest, to be prefilled up to where it
        was. -> False, and nothing taken, while they are not all available."""
        plans, need = [], 0
        for s in req.samples:
            if s.finished:
                continue
            tokens = req.tokens(s)[:s.target]
            s.digests = chain(tokens, self.block_size, s.digests) if self.prefix_caching else []
            h, hits = self._hits(s.digests, s.target - 1)
            need += self.groups * (self.pool.blocks_for(s.target) - h)
            plans.append((s, h, hits))
        if not self._room(need, [t for _, _, hits in plans for t in hits]):
            return False
        for s, h, hits in plans:
            s.tables = []
            for g in range(self.groups):
                self.pool.take(hits[g])
                s.tables.append(hits[g] + self.pool.allocate(self.pool.blocks_for(s.target) - h))
            s.committed = h
            s.behind = [0] * self.groups
            s.position = h * self.block_size
        req.preempted = False
        return True

    @staticmethod
    def _pending_overlap(feed: list[int], pending: list[Request]) -> int:
        """The most leading tokens `feed` shares with any of `pending`'s feeds (at most all but its last)."""
        best = 0
        for other in pending:
            f = other.feed
            lo, hi = 0, min(len(f), len(feed) - 1)
            if hi <= best or f[:DEFER_MIN] != feed[:DEFER_MIN]:
                continue
            while lo < hi:                       # the longest common prefix, by halving (slices compare in C)
                mid = (lo + hi + 1) // 2
                if f[:mid] == feed[:mid]:
                    lo = mid
                else:
                    hi = mid - 1
            best = max(best, lo)
        return best

    def _scored_reuse(self, req: Request, h: int, digests: list[bytes]) -> bool:
        """Whether a request that asks for prompt logprobs may reuse the h cached blocks it hit: a memo must cover
        them with as many alternatives; it then takes the memo's entries for their positions but the last, whose
        logits score the first new token (req.prompt_entries). Otherwise its prompt is computed whole."""
        memo = self.prompt_memo.get(digests[h - 1]) if h else None
        if memo is None or memo[0] < req.params.prompt_logprobs:
            req.prompt_entries = [(req.prompt[0], None, None)]
            return False
        req.prompt_entries = list(memo[1][:h * self.block_size])
        return True

    def scored(self, req: Request) -> list:
        """`req`'s prompt logprobs are complete: -> them, and the cached blocks of its prompt remember them for
        later prompts (by digest: each memo covers at least its block)."""
        entries, req.prompt_entries = req.prompt_entries, None
        first = req.samples[0]
        for d in first.digests[:min(first.committed, len(req.prompt) // self.block_size)]:
            self.prompt_memo[d] = (req.params.prompt_logprobs, entries)
        return entries

    def start_prefill(self, req: Request) -> None:
        self.prefilling.append(req)

    def start_running(self, req: Request) -> None:
        """A request that goes straight to decoding (or that ended while admitted: retire frees its rows)."""
        self.running.append(req)

    def prefill_batch(self) -> list[tuple[Request, Sample, int]]:
        """(request, sample, tokens to feed it this step), within prefill_chunk tokens in all: a new prompt's
        first sample, or each sample of a preempted request, up to its target."""
        budget, batch = self.prefill_chunk, []
        for req in self.prefilling:
            for s in req.samples:
                if budget <= 0:
                    return batch
                if s.position < s.target and not s.finished:
                    take = min(budget, s.target - s.position)
                    batch.append((req, s, take))
                    budget -= take
        return batch

    def filled(self, req: Request, s: Sample) -> None:
        """`s` has written its positions up to s.position: register its newly full blocks in the prefix cache, and
        give back the blocks of sliding-window groups that its next positions' windows no longer see (they stay
        cached, as any released block)."""
        bs = self.block_size
        full = s.position // bs
        if self.prefix_caching and full > s.committed:
            chain(req.tokens(s)[:full * bs], bs, s.digests)
            for g in range(self.groups):
                self.pool.commit(g, s.tables[g], s.digests, s.committed, full)
            s.committed = full
        if self.windowed:
            for g, w in enumerate(self.windows):
                if w is None:
                    continue
                gone = max(0, s.position - w) // bs        # block i is seen no more once (i + 1) * bs <= pos - w
                table = s.tables[g]
                if gone > s.behind[g]:
                    self.pool.release(table[s.behind[g]:gone])
                    table[s.behind[g]:gone] = [SCRATCH] * (gone - s.behind[g])
                    s.behind[g] = gone

    def prefilled(self, req: Request) -> list[tuple[int, int]]:
        """`req`'s prefill is done: it decodes from now on. A new prompt's other samples share its first
        sample's full blocks and take a reserved block for the partly filled last one, in each layer group; ->
        the (source, destination) blocks to copy for them."""
        self.prefilling.remove(req)
        self.running.append(req)
        copies = []
        if not req.started:
            req.started = True
            first = req.samples[0]
            full = first.position // self.block_size
            for s in req.samples[1:]:
                s.tables = []
                for table in first.tables:
                    self.pool.take(table[:full])
                    mine = table[:full]
                    if len(table) > full:
                        block = req.reserved.pop()
                        mine = mine + [block]
                        copies.append((table[full], block))
                    s.tables.append(mine)
                s.committed = min(first.committed, full)
                s.digests = list(first.digests[:s.committed])
                s.behind = list(first.behind)
                s.position = s.target = first.position
        return copies

    def decoding(self) -> list[tuple[Request, Sample]]:
        """The samples that decode a token this step, in row order. A prompt that finishes prefilling this step
        starts decoding at the next: every sample gets at most one token per step."""
        out = [(r, s) for r in self.running for s in r.samples if not s.finished]
        out.sort(key=lambda rs: rs[1].row)
        return out

    def grow(self, decoding: list[tuple[Request, Sample]]) -> list[tuple[Request, Sample]]:
        """A block (one per layer group) for each decoding sample whose next position starts one; where none is
        left, the most recently
        admitted running request is preempted (`preempt`), until the rest have theirs. -> the samples that
        decode this step (a preempted request's leave the list)."""
        out = list(decoding)
        i = 0
        while i < len(out):
            req, s = out[i]
            if s.position < len(s.tables[0]) * self.block_size:
                i += 1
                continue
            blocks = self.pool.allocate(self.groups)
            if blocks is not None:
                for table, block in zip(s.tables, blocks):
                    table.append(block)
                i += 1
                continue
            victim = max((r for r in self.running if not r.done), key=lambda r: self._order.get(r.id, 0))
            self.preempt(victim)
            out = [(r, x) for r, x in out if r is not victim]
            i = 0
        return out

    def preempt(self, req: Request) -> None:
        """Give back a running request's blocks (its full ones stay cached) and queue it first, to compute its
        samples' keys again (readmit, prefill) and go on where it was; it keeps its rows and its outputs."""
        for s in req.samples:
            for table in s.tables:
                self.pool.release(table)
            s.tables, s.committed = [], 0
            if not s.finished:
                s.target = s.position
                s.position = 0
        self.running.remove(req)
        req.preempted = True
        self.preemptions += 1
        self.waiting.appendleft(req)

    def unfinished(self) -> list[tuple[Request, Sample]]:
        """Every sample of every request not yet finished (to end them all after a fault); the waiting queue is
        emptied (preempted requests move to running, so that retire gives their rows back)."""
        with self._lock:
            while self._inbox:
                self.waiting.append(self._inbox.popleft())
            self._aborts.clear()
        out = [(r, s) for r in list(self.waiting) + self.prefilling + self.running for s in r.samples
               if not s.finished]
        self.running += [r for r in self.waiting if r.preempted]
        self.waiting.clear()
        return out

    def retire(self) -> None:
        """Give back the rows and blocks of finished samples (full blocks stay cached) and forget finished
        requests."""
        for req in list(self.prefilling) + list(self.running):
            for s in req.samples:
                if s.finished and s.row >= 0:
                    for table in s.tables:
                        self.pool.release(table)
                    s.tables = []
                    self.free_rows.add(s.row)
                    s.row = -1
            if req.done:
                self.pool.release(req.reserved)
                req.reserved = []
                (self.prefilling if req in self.prefilling else self.running).remove(req)
                self._order.pop(req.id, None)
        with self._lock:
            for rid in [rid for rid, r in self.requests.items() if r.done]:
                del self.requests[rid]
