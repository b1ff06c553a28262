"""The chat engine: continuous batching over a preallocated KV cache.

Design (after vLLM's v1 engine, at nanochat's scale):
- A request is a prompt and `SamplingParams`; each of its `n` samples owns one row of the KV cache.
- `step()` is one scheduling round: apply aborts, admit waiting requests while rows are free (FIFO,
  so nobody starves), prefill up to `prefill_chunk` prompt tokens (several short prompts together,
  long ones a chunk per step so running streams keep flowing), then one forward pass that decodes a
  token for every running sample. It returns the token events of that step; a caller that streams can
  have the first tokens of the prefill handed over before the decode pass.
- `n` samples of a prompt share one prefill: its keys and values are copied to the sibling rows and
  each sample draws its own first token (seed 000 broadcast one first token to all).
- Prefix caching (prefix_index.py): a finished request's rows keep their keys and values, indexed by their
  token ids; a new prompt that starts with the same ids takes over such a row (or copies from a row that
  must stay: a running request's, or the pinned row of the few-shot prefix) and prefills only the rest.
- The calculator runs between steps: after `<|python_end|>` its result is forced into the row.
- A request may continue an earlier generation of the same prompt (`resume`: the tokens that generation had
  delivered, e.g. on a replica that was lost): those tokens are prefilled after the prompt and replayed through
  the per-token bookkeeping (tool state, text decoder, stop strings, penalties) and the sample's random stream
  advances one draw per token, as it did in the first run, so the continuation is the rest of that run.
- When every row is taken, new requests wait; `max_waiting` bounds the queue.

`Engine` keeps seed 000's offline API (`generate`, `generate_batch`) on top of the same machinery.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .calculator import format_result, use_calculator
from .cuda_graphs import DecodeGraphs, GraphCaptureError
from .kv_cache import CacheBatch, KVCache
from .logits import LogitProcessor, LogprobResult, logprobs
from .model import ChatModel
from .prefix_index import RowPool
from .sampler import SamplingError, SamplingParams, row_rng, sample
from .tokenizer import ChatTokenizer

logger = logging.getLogger(__name__)

_ids = itertools.count()


class EngineError(ValueError):
    """A request the engine cannot take as given."""


class EngineFull(RuntimeError):
    """The waiting queue is full; retry later."""


@dataclass
class TokenEvent:
    """One token of one sample, or the end of a sample (`finish_reason` set, `token` None)."""

    request_id: str
    index: int                      # sample index within the request
    token: int | None
    text: str = ""                  # text delta of this token in its segment
    segment: str = "text"           # "text", "python" (calculator call) or "python_output" (its result)
    forced: bool = False            # injected by the tool, not sampled
    closes: bool = False            # this token (<|python_end|> or <|output_end|>) ends its segment
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0          # prompt tokens whose keys and values were reused, not computed
    logprob: float | None = None    # of a sampled token, when the request asked for logprobs
    top_logprobs: list[tuple[int, float]] | None = None   # (token id, logprob), most probable first


@dataclass
class _Sample:
    index: int
    rng: object
    decoder: object
    row: int = -1
    position: int = 0               # tokens of this row already in the cache
    pending: int | None = None      # last token, not yet fed to the model
    generated: list[int] = field(default_factory=list)
    forced: deque = field(default_factory=deque)
    segment: str = "text"
    expr_tokens: list[int] = field(default_factory=list)
    held: str = ""                  # text held back because it may begin a stop string
    finish_reason: str | None = None


@dataclass
class _Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    max_new: int
    samples: list[_Sample]
    resume: list[int] = field(default_factory=list)   # tokens already generated, continued from (n == 1)
    prefilled: int = 0
    cached: int = 0                 # prompt tokens reused (the few-shot prefix)
    arrival: float = field(default_factory=time.monotonic)
    aborted: bool = False

    @property
    def done(self) -> bool:
        return all(s.finish_reason for s in self.samples)

    @property
    def feed(self) -> list[int]:
        """What the first sample's row is prefilled with: the prompt, then the tokens continued from."""
        return self.prompt + self.resume if self.resume else self.prompt


@dataclass
class EngineStats:
    running: int
    waiting: int
    rows_used: int
    rows_total: int
    cache_tokens: int            # positions stored in the KV cache across rows
    cache_capacity: int          # rows * sequence_len
    prefix_query_tokens: int = 0     # prompt tokens looked up in the prefix index
    prefix_hit_tokens: int = 0       # of those, found in a cached row (reused, not computed)
    cached_rows: int = 0             # free rows that hold a prefix
    cached_prefix_tokens: int = 0    # tokens those rows hold

    @property
    def cache_usage(self) -> float:
        return self.cache_tokens / self.cache_capacity if self.cache_capacity else 0.0


class LLMEngine:
    def __init__(self, model: ChatModel, tokenizer: ChatTokenizer, max_rows: int = 32, prefill_chunk: int = 512,
                 initial_cache_len: int | None = 256, prefix_ids: list[int] | None = None, max_waiting: int = 1024,
                 cuda_graphs: bool = True, prefix_caching: bool = True):
        """cuda_graphs: on a CUDA device, replay recorded graphs for decode passes (cuda_graphs.py); the cache is
        then allocated at full length, with one extra scratch row. prefix_caching: reuse the keys and values
        finished requests leave in their rows (prefix_index.py); without it only the few-shot prefix is reused.
        The cache has one more row, pinned to the few-shot prefix."""
        self.model, self.tok = model.eval(), tokenizer
        cfg = model.config
        self.sequence_len = cfg.sequence_len
        self.max_rows, self.prefill_chunk, self.max_waiting = max_rows, max(1, prefill_chunk), max_waiting
        self.device = model.get_device()
        dtype = next(model.parameters()).dtype
        self.graphs = None
        self.prefix_row = max_rows                      # pinned to the few-shot prefix
        if cuda_graphs and self.device.type == "cuda":
            self.cache = KVCache.for_model(cfg, max_rows + 2, cfg.sequence_len, dtype=dtype, device=self.device)
            self.graphs = DecodeGraphs(model, self.cache, scratch_row=max_rows + 1, max_batch=max_rows)
        else:
            self.cache = KVCache.for_model(cfg, max_rows + 1, initial_cache_len, dtype=dtype, device=self.device)
        t = tokenizer.encode_special
        self.python_start, self.python_end = t("<|python_start|>"), t("<|python_end|>")
        self.output_start, self.output_end = t("<|output_start|>"), t("<|output_end|>")
        self.stop_tokens = {t("<|assistant_end|>"), tokenizer.bos_id}
        self.logits = LogitProcessor(max_rows, cfg.vocab_size, self.device)
        self._observed: tuple[list[int], list[int]] = ([], [])   # (row, token) appended to processed rows
        self.prefix_caching = prefix_caching
        self.pool = RowPool(max_rows)
        self.waiting: deque[_Request] = deque()
        self.prefilling: list[_Request] = []
        self.running: list[_Request] = []
        self.requests: dict[str, _Request] = {}
        self._inbox: deque[_Request] = deque()
        self._aborts: set[str] = set()
        self._lock = threading.Lock()
        self.prefix_ids: list[int] = []
        if prefix_ids:
            self.set_prefix(prefix_ids)

    # ---- requests in and out (safe to call from another thread than step())
    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                    resume: list[int] | None = None) -> str:
        """Queue a request; -> its id. resume: the tokens an earlier run of this prompt and these parameters had
        generated; the request continues that run (events for the new tokens only; token counts include them)."""
        if not prompt:
            raise EngineError("the prompt is empty")
        if len(prompt) >= self.sequence_len:
            raise EngineError(f"the prompt has {len(prompt)} tokens; the model's context is {self.sequence_len}")
        if params.n > self.max_rows:
            raise EngineError(f"n={params.n} exceeds the {self.max_rows} sequences this engine runs at once")
        vocab = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise EngineError(f"prompt token ids must be in [0, {vocab})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise SamplingError(f"logit_bias token ids must be in [0, {vocab})", "logit_bias")
        max_new = min(params.max_tokens, self.sequence_len - len(prompt))
        if resume:
            self._check_resume(resume, params, max_new)
        rid = request_id or f"req-{next(_ids)}"
        samples = [_Sample(i, row_rng(params.seed, i), self.tok.stream_decoder()) for i in range(params.n)]
        req = _Request(rid, list(prompt), params, max_new, samples, list(resume or []))
        with self._lock:
            if rid in self.requests:
                raise EngineError(f"request id {rid!r} is already in use")
            if len(self.waiting) + len(self._inbox) >= self.max_waiting:
                raise EngineFull(f"{self.max_waiting} requests are already waiting")
            self.requests[rid] = req
            self._inbox.append(req)
        return rid

    def _check_resume(self, resume: list[int], params: SamplingParams, max_new: int) -> None:
        if params.n != 1:
            raise EngineError("only a request with n=1 can continue an earlier generation")
        if len(resume) >= max_new:
            raise EngineError(f"the generation continued from has {len(resume)} tokens; nothing is left of the "
                              f"{max_new} it may have")
        if min(resume) < 0 or max(resume) >= self.model.config.vocab_size:
            raise EngineError("continued token ids must be in the vocabulary")
        if not params.ignore_eos and self.stop_tokens & set(resume):
            raise EngineError("the generation continued from has already ended")

    def abort(self, request_id: str) -> None:
        """Stop a request; its rows are freed at the next step."""
        with self._lock:
            if request_id in self.requests:
                self._aborts.add(request_id)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.requests)

    def stats(self) -> EngineStats:
        with self._lock:
            waiting = len(self.waiting) + len(self._inbox)
            active = [s for r in self.prefilling + self.running for s in r.samples if s.row >= 0]
        pool = self.pool
        return EngineStats(len(self.prefilling) + len(self.running), waiting, self.max_rows - pool.n_free,
                           self.max_rows, sum(s.position for s in active), self.max_rows * self.sequence_len,
                           pool.query_tokens, pool.hit_tokens, pool.cached_rows, pool.cached_tokens())

    # ---- the few-shot prefix
    @torch.inference_mode()
    def set_prefix(self, prefix_ids: list[int]) -> None:
        """Prefill `prefix_ids` once into the pinned row; prompts that start with them copy its keys and values."""
        ids = torch.tensor([prefix_ids], device=self.device)
        self.model(ids, CacheBatch.build(self.cache, [self.prefix_row], [0], len(prefix_ids)),
                   last=torch.tensor([0], device=self.device))
        self.prefix_ids = list(prefix_ids)
        self.pool.pin(self.prefix_row, self.prefix_ids)

    # ---- one scheduling round
    @torch.inference_mode()
    def step(self, emit=None) -> list[TokenEvent]:
        """One scheduling round; returns its events. With `emit`, the events ready before the decode pass (the
        first tokens of prompts that finished prefilling, aborts) go to `emit(events)` at once instead, so a new
        request's first token does not wait for every running row's next token."""
        events: list[TokenEvent] = []
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            while self._inbox:
                self.waiting.append(self._inbox.popleft())
        for rid in aborts:
            self._abort(rid, events)
        self._admit(events)
        # every sample gets at most one token per step: prompts that finish prefilling now start decoding next step
        decoding = [(r, s) for r in self.running for s in r.samples if not s.finish_reason]
        if self.prefilling:
            self._prefill(events)
        if emit is not None and events and decoding:
            emit(events)
            events = []
        if decoding:
            self._decode(decoding, events)
        self._retire()
        return events

    def _abort(self, rid: str, events: list[TokenEvent]) -> None:
        req = self.requests.get(rid)
        if req is None or req.done:
            return
        req.aborted = True
        if req in self.waiting:
            self.waiting.remove(req)
        for s in req.samples:
            if not s.finish_reason:
                self._finish(req, s, "abort", events)

    def _admit(self, events: list[TokenEvent]) -> None:
        """Waiting requests get rows in arrival order while there are enough free ones. The first sample's row starts
        with the longest cached prefix of the prompt (at least the last prompt token is always computed, for the
        logits to sample from): a free row holding it is taken over as it is, else the prefix is copied in."""
        while self.waiting and self.pool.n_free >= self.waiting[0].params.n:
            req = self.waiting.popleft()
            feed = req.feed
            m = self.pool.match(feed, limit=len(feed) - 1)
            first = req.samples[0]
            if m.length and m.free:
                self.pool.take(m.row)
                first.row = m.row
            else:
                first.row = self.pool.allocate()
                if m.length:
                    self.cache.ensure_capacity(m.length)
                    self.cache.copy_rows(m.row, [first.row], m.length)
            for s in req.samples[1:]:
                s.row = self.pool.allocate()
            for s in req.samples:
                if req.params.processes_logits:
                    self.logits.start(s.row, req.params, req.prompt)
            req.prefilled, req.cached = m.length, min(m.length, len(req.prompt))
            if req.resume and not self._replay(req, first, events):
                self.running.append(req)            # it ended inside the replay: _retire frees its row
                continue
            self.prefilling.append(req)

    def _replay(self, req: _Request, s: _Sample, events: list[TokenEvent]) -> bool:
        """Bring sample `s` to where the run it continues stopped: each resumed token goes through `_accept` (its
        events are dropped: they were delivered before) and takes one draw of the sample's random stream, as a
        step does for every row, forced or not. -> whether the sample is still running (a stop string hit by
        the replay ends it, with its finish event)."""
        scratch: list[TokenEvent] = []
        for tok in req.resume:
            s.rng.random()
            forced = bool(s.forced) and s.forced[0] == tok
            if forced:
                s.forced.popleft()
            else:
                s.forced.clear()        # the client's tokens left the calculator's result: theirs stand
            self._accept(req, s, tok, forced, scratch)
            if s.finish_reason:
                events.append(scratch[-1])
                return False
        self._observe()                 # penalties count the resumed tokens before the first new one is drawn
        return True

    def _prefill(self, events: list[TokenEvent]) -> None:
        budget, batch = self.prefill_chunk, []
        feeds = {}
        for req in self.prefilling:
            if budget <= 0:
                break
            feeds[req.id] = feed = req.feed
            take = min(budget, len(feed) - req.prefilled)
            batch.append((req, take))
            budget -= take
        T = max(take for _, take in batch)
        ids = torch.zeros(len(batch), T, dtype=torch.long)
        for j, (req, take) in enumerate(batch):
            ids[j, :take] = torch.tensor(feeds[req.id][req.prefilled:req.prefilled + take])
        rows = [req.samples[0].row for req, _ in batch]
        start = [req.prefilled for req, _ in batch]
        # right padding: a padded position lies beyond its row's prompt, is masked for that row's queries and is
        # overwritten before the row ever reaches it.
        cb = CacheBatch.build(self.cache, rows, start, T)
        last = torch.tensor([take - 1 for _, take in batch], device=self.device)
        logits = self.model(ids.to(self.device), cb, last=last)
        finished = []
        for j, (req, take) in enumerate(batch):
            req.prefilled += take
            if req.prefilled == len(feeds[req.id]):
                finished.append((j, req))
        if not finished:
            return
        # each sample of a finished prompt draws its own first token from the prompt's last logits
        rows_logits, targets = [], []
        for j, req in finished:
            feed = feeds[req.id]
            self.cache.copy_rows(req.samples[0].row, [s.row for s in req.samples[1:]], len(feed))
            if self.prefix_caching:                 # the prompt's keys are final: other requests may copy them
                self.pool.hold(req.samples[0].row, feed)
            for s in req.samples:
                s.position = len(feed)
                rows_logits.append(j)
                targets.append((req, s))
            self.prefilling.remove(req)
            self.running.append(req)
        tokens, lps = self._sample(logits[torch.tensor(rows_logits, device=self.device)], targets)
        for (req, s), tok, lp in zip(targets, tokens, lps):
            if s.forced:                            # a continuation that stopped inside a calculator result
                self._accept(req, s, s.forced.popleft(), True, events)
            else:
                self._accept(req, s, tok, False, events, lp)
        self._observe()

    def _sample(self, logits: torch.Tensor,
                targets: list[tuple[_Request, _Sample]]) -> tuple[list[int], list[LogprobResult | None]]:
        """Sample one token per target row; the rows whose requests ask for it get their logits processed first
        (bias, penalties) and their log-probabilities computed (not for a row whose next token the calculator
        forces: it is not sampled)."""
        ps = [r.params for r, _ in targets]
        processed = [i for i, p in enumerate(ps) if p.processes_logits]
        if processed:
            logits = self.logits.apply(logits.float(), processed, [targets[i][1].row for i in processed],
                                       [ps[i] for i in processed])
        tokens = sample(logits, [p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps],
                        [s.rng.random() for _, s in targets]).tolist()
        lps: list[LogprobResult | None] = [None] * len(targets)
        asked = [i for i, p in enumerate(ps) if p.logprobs is not None and not targets[i][1].forced]
        if asked:
            for i, res in zip(asked, logprobs(logits, asked, [tokens[i] for i in asked],
                                              [ps[i].logprobs for i in asked])):
                lps[i] = res
        return tokens, lps

    def _observe(self) -> None:
        rows, toks = self._observed
        if rows:
            self.logits.observe(rows, toks)
            self._observed = ([], [])

    def _decode(self, decoding: list[tuple[_Request, _Sample]], events: list[TokenEvent]) -> None:
        decoding.sort(key=lambda rs: rs[1].row)
        rows, positions = [s.row for _, s in decoding], [s.position for _, s in decoding]
        logits = None
        if self.graphs is not None:
            try:
                logits = self.graphs.run([s.pending for _, s in decoding], rows, positions)
            except GraphCaptureError:
                logger.exception("CUDA graphs for decode are off from now on; decoding eagerly")
                self.graphs = None
        if logits is None:
            ids = torch.tensor([[s.pending] for _, s in decoding], device=self.device)
            cb = CacheBatch.build(self.cache, rows, positions, 1)
            logits = self.model(ids, cb, last=torch.zeros(len(decoding), dtype=torch.long, device=self.device))
        sampled, lps = self._sample(logits, decoding)
        for (req, s), tok, lp in zip(decoding, sampled, lps):
            s.position += 1
            if s.forced:
                self._accept(req, s, s.forced.popleft(), True, events)
            else:
                self._accept(req, s, tok, False, events, lp)
        self._observe()

    # ---- per-token bookkeeping: tool state machine, text, stop conditions
    def _accept(self, req: _Request, s: _Sample, tok: int, forced: bool, events: list[TokenEvent],
                lp: LogprobResult | None = None) -> None:
        s.generated.append(tok)
        s.pending = tok
        if req.params.processes_logits:
            self._observed[0].append(s.row)
            self._observed[1].append(tok)
        text, segment, closes = "", s.segment, False
        if tok in self.stop_tokens:
            if not req.params.ignore_eos:
                self._finish(req, s, "stop", events)
                return
            # ignore_eos (benchmarks): the end of the turn counts as a generated token but shows no text
        elif tok == self.python_start:
            text = self._flush_text(s)
            s.segment, s.expr_tokens = "python", []
        elif tok == self.python_end and s.segment == "python":
            text, closes = s.decoder.flush(), True
            s.segment = "text"
            value = use_calculator(self.tok.decode(s.expr_tokens))
            if value is not None:
                s.forced.extend([self.output_start, *self.tok.encode(format_result(value)), self.output_end])
        elif tok == self.output_start:
            text = self._flush_text(s)
            s.segment = "python_output"
        elif tok == self.output_end and s.segment == "python_output":
            text, closes = s.decoder.flush(), True
            s.segment = "text"
        else:
            delta = s.decoder.feed(tok)
            if s.segment == "python":
                s.expr_tokens.append(tok)
            if s.segment == "text" and req.params.stop:
                text, hit = self._check_stop(s, delta, req.params.stop)
                if hit:
                    events.append(self._event(req, s, tok, text, "text", forced, lp=lp))
                    self._finish(req, s, "stop", events, flush=False)
                    return
            else:
                text = delta
        events.append(self._event(req, s, tok, text, segment, forced, closes=closes, lp=lp))
        if len(s.generated) >= req.max_new or s.position + 1 >= self.sequence_len:
            self._finish(req, s, "length", events)

    @staticmethod
    def _check_stop(s: _Sample, delta: str, stops: list[str]) -> tuple[str, bool]:
        """-> (text safe to emit, whether a stop string was hit). Holds back a tail that may begin a stop string."""
        buf = s.held + delta
        hits = [i for i in (buf.find(stop) for stop in stops) if i >= 0]
        if hits:
            s.held = ""
            return buf[:min(hits)], True
        hold = 0
        for stop in stops:
            for n in range(min(len(stop) - 1, len(buf)), 0, -1):
                if buf.endswith(stop[:n]):
                    hold = max(hold, n)
                    break
        s.held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False

    @staticmethod
    def _flush_text(s: _Sample) -> str:
        text = s.held + s.decoder.flush()
        s.held = ""
        return text

    def _event(self, req, s, tok, text, segment, forced, finish=None, closes=False, lp=None) -> TokenEvent:
        return TokenEvent(req.id, s.index, tok, text, segment, forced, closes, finish, len(req.prompt),
                          len(s.generated), req.cached, lp.logprob if lp else None, lp.top if lp else None)

    def _finish(self, req: _Request, s: _Sample, reason: str, events: list[TokenEvent], flush: bool = True) -> None:
        tail = self._flush_text(s) if flush else ""
        s.finish_reason = reason
        events.append(self._event(req, s, None, tail, s.segment if tail else "text", False, reason))

    def _retire(self) -> None:
        """Free the rows of finished samples and forget finished requests."""
        for req in list(self.prefilling) + list(self.running):
            for s in req.samples:
                if s.finish_reason and s.row >= 0:
                    self.pool.release(s.row, self._fed(req, s) if self.prefix_caching else [])
                    s.row = -1
            if req.done:
                (self.prefilling if req in self.prefilling else self.running).remove(req)
        with self._lock:
            for rid in [rid for rid, r in self.requests.items() if r.done]:
                del self.requests[rid]

    @staticmethod
    def _fed(req: _Request, s: _Sample) -> list[int]:
        """The tokens whose keys and values sample `s`'s row holds: what was fed into it (the last sampled token
        never was). A sample whose prompt was still prefilling holds the prefilled part if it is the first."""
        if s.position:
            return (req.prompt + s.generated)[:s.position]
        return req.feed[:req.prefilled] if s is req.samples[0] else []

    def fail_all(self, reason: str = "error") -> list[TokenEvent]:
        """End every request (after a fault in the model); the engine stays usable."""
        events: list[TokenEvent] = []
        with self._lock:
            while self._inbox:
                self.waiting.append(self._inbox.popleft())
            self._aborts.clear()
        for req in list(self.waiting) + self.prefilling + self.running:
            for s in req.samples:
                if not s.finish_reason:
                    s.held = ""
                    s.finish_reason = reason
                    events.append(self._event(req, s, None, "", "text", False, reason))
        self.waiting.clear()
        self._retire()
        return events


class Engine:
    """Seed 000's offline API: `generate` yields (token_column, token_masks) per step for `num_samples` rows of
    one prompt; `generate_batch` returns the finished sequences. A row that has ended repeats its terminal
    token with mask 0 in later columns (generate_batch drops it)."""

    def __init__(self, model: ChatModel, tokenizer: ChatTokenizer):
        self.model, self.tokenizer = model, tokenizer

    def generate(self, tokens: list[int], num_samples: int = 1, max_tokens: int | None = None,
                 temperature: float = 1.0, top_k: int | None = None, seed: int = 42):
        assert isinstance(tokens, list) and isinstance(tokens[0], int), "expecting list of ints"
        engine = LLMEngine(self.model, self.tokenizer, max_rows=num_samples, prefill_chunk=len(tokens))
        max_tokens = max_tokens or (self.model.config.sequence_len - len(tokens))
        rid = engine.add_request(tokens, SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                                         seed=seed, n=num_samples))
        last = [None] * num_samples
        while engine.has_work():
            column, masks, produced = list(last), [0] * num_samples, False
            for ev in engine.step():
                if ev.request_id == rid and ev.token is not None:
                    column[ev.index], masks[ev.index] = ev.token, 0 if ev.forced else 1
                    last[ev.index], produced = ev.token, True
            if produced:
                yield column, masks

    def generate_batch(self, tokens: list[int], num_samples: int = 1, **kwargs):
        terminal = {self.tokenizer.encode_special("<|assistant_end|>"), self.tokenizer.bos_id}
        results = [list(tokens) for _ in range(num_samples)]
        masks = [[0] * len(tokens) for _ in range(num_samples)]
        completed = [False] * num_samples
        for column, column_masks in self.generate(tokens, num_samples, **kwargs):
            for i, (tok, mask) in enumerate(zip(column, column_masks)):
                if completed[i] or tok is None:
                    continue
                if tok in terminal:
                    completed[i] = True
                else:
                    results[i].append(tok)
                    masks[i].append(mask)
        return results, masks
