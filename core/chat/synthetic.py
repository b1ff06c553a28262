"""A chat engine without a model, for benchmarks and tests of the serving path: `chat_engine: synthetic`.

`SyntheticEngine` has the interface of `LLMEngine` (add_request, abort, has_work, step, stats, fail_all) and its
scheduling (scheduler.py: rows, the waiting queue, admission in arrival order) and output side (outputs.py:
the text decoder, stop strings, finishes), but no weights and no torch. Each step takes `synthetic_step_s` (an
H200's step by default: 1.25 ms, so 32 rows make 25,600 tokens/s) and gives every running sample one token;
a prompt is "prefilled" at once, its first token in the step that admits it. The tokens are real tokens of the
checkpoint's tokenizer: a fixed English text, encoded once, that each sample reads from its own starting point
(drawn from its seed and index, so a seeded request gives the same tokens every time and a continued one
(`resume`) goes on where its run stopped). Logprobs and prompt logprobs are made up (fixed values).

What it is for: measuring what the serving processes (HAProxy, the Ingress, the chat replica, the engine
client) cost per token at a GPU's rate on a host without one (bench/relay.py), and tests of that path. It
never ends a turn by itself (a sample ends at max_tokens, the context, a stop string or an abort), and it
refuses what needs a model: structured outputs (tools that must be called, response_format).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import msgspec

from .outputs import OutputProcessor
from .protocol import EngineConfig, EngineError, EngineStats, SamplingParams, TokenEvent
from .scheduler import Request, Sample, Scheduler, new_request
from .tokenizer import ChatTokenizer

_ids = itertools.count()

# what the samples read: plain prose, so the text decoder, stop strings and JSON escaping see ordinary text
TEXT = (
    "The harbour was quiet before dawn. Fishing boats rocked against the pier, their lanterns still lit, and "
    "a gull walked along the rail as if it owned the place. Maria checked the nets twice, counted the crates, "
    "and wrote the numbers in a notebook whose pages had gone soft with salt. Her brother arrived late, as "
    "usual, with two cups of coffee and a story about the baker's dog. \"It opened the door by itself,\" he "
    "said, \"and sat down by the oven like a customer.\" She laughed, took the coffee, and pointed at the sky: "
    "clouds were building in the west, grey over green water. They would have four hours, maybe five, before "
    "the wind turned. The engine coughed, caught, and settled into its steady rhythm; the town slid behind "
    "them, roofs first, then the church tower, then only the lighthouse, white against the hills. "
)


@dataclass(frozen=True, slots=True)
class ReplayLogprob:
    """A made-up log-probability for a synthetic token, in the shape the output side reads (LogprobResult's)."""

    logprob: float
    top: list[tuple[int, float]]


class SyntheticEngine:
    def __init__(self, tokenizer: ChatTokenizer, sequence_len: int, vocab_size: int,
                 config: EngineConfig | None = None, prefix_ids: list[int] | None = None):
        """`prefix_ids` (the few-shot prefix) is accepted and not used: nothing is computed for a prompt."""
        config = config or EngineConfig(backend="synthetic")
        self.config = config
        self.tok, self.sequence_len, self.vocab_size = tokenizer, sequence_len, vocab_size
        self.linear = self.attention = self.dtype = self.decode = "none"   # no model (LLMEngine's say how one runs)
        self.max_rows = config.max_rows
        self.step_s = config.synthetic_step_s
        self.device = "synthetic"
        self.text = tokenizer.encode(TEXT)
        self.outputs = OutputProcessor(tokenizer, sequence_len)
        # nothing is cached (prefix caching would only make admission search blocks that hold nothing), and the
        # blocks (bookkeeping only: there is no cache) are enough for every row's whole context
        per_row = -(-sequence_len // config.block_size)
        self.scheduler = Scheduler(EngineConfig(max_rows=config.max_rows, max_waiting=config.max_waiting,
                                                prefix_caching=False), 2 + config.max_rows * per_row,
                                   config.block_size)
        self._due = 0.0                                   # when the next step may run

    # ---- requests in and out (any thread)
    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                    resume: list[int] | None = None) -> str:
        if params.grammar is not None:
            raise EngineError("the synthetic engine (chat_engine: synthetic, for benchmarks) has no model and cannot "
                              "follow a structured output (tools or response_format)")
        req = new_request(request_id or f"synthetic-{next(_ids)}", prompt, params, resume, self.sequence_len,
                          self.vocab_size, self.max_rows, self.outputs)
        self.scheduler.add(req)
        return req.id

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> EngineStats:
        return self.scheduler.stats()

    # ---- one step
    def step(self, emit=None) -> list[TokenEvent]:
        """One step: wait out the step time, then the first token of every request admitted now and one token of
        every sample that was running (`emit`, as LLMEngine's: the first tokens go out before the rest)."""
        self._pace()
        sched = self.scheduler
        events: list[TokenEvent] = []
        for req in sched.collect():
            events += [self.outputs.finish(req, s.output, "abort") for s in req.samples if not s.finished]
        decoding = sched.decoding()
        for adm in sched.admit():
            self._begin(adm.request, events)
        if emit is not None and events and decoding:
            emit(events)
            events = []
        for req, s in decoding:
            self._next(req, s, events)
        sched.retire()
        return events

    def fail_all(self, reason: str = "error") -> list[TokenEvent]:
        events = [self.outputs.fail(req, s.output, reason) for req, s in self.scheduler.unfinished()]
        self.scheduler.retire()
        return events

    # ---- the made-up generation
    def _pace(self) -> None:
        """Sleep until the step is due; a late step runs at once and does not make the next one early."""
        now = time.monotonic()
        if self._due > now:
            time.sleep(self._due - now)
            now = self._due
        self._due = now + self.step_s

    def _begin(self, req: Request, events: list[TokenEvent]) -> None:
        """A request admitted this step: its resumed tokens replayed, then every sample's first token."""
        self.scheduler.start_running(req)
        p = req.params
        for s in req.samples:
            s.position = len(req.feed)
            s.pending = s.rng.randrange(len(self.text)) + len(req.resume)   # here: its place in the text
        if req.resume:
            finish = self.outputs.replay(req, req.samples[0].output, req.resume)
            if finish is not None:
                events.append(finish)
                return
        if req.max_new == 0:                        # score the prompt only
            for s in req.samples:
                finish = self.outputs.finish(req, s.output, "length")
                if s is req.samples[0] and p.prompt_logprobs is not None:
                    finish = msgspec.structs.replace(finish, prompt_logprobs=self._prompt_logprobs(req))
                events.append(finish)
            return
        for s in req.samples:
            self._next(req, s, events, self._prompt_logprobs(req) if s is req.samples[0] else None)

    def _next(self, req: Request, s: Sample, events: list[TokenEvent], prompt_logprobs=None) -> None:
        """Sample `s`'s next token: the text's token at its place (s.pending counts the tokens read)."""
        k = req.params.logprobs
        tok = self.text[s.pending % len(self.text)]
        lp = None
        if k is not None:
            alternatives = [self.text[(s.pending + j) % len(self.text)] for j in range(1, k + 1)]
            lp = ReplayLogprob(-0.25, [(tok, -0.25)] + [(t, -2.0 - j) for j, t in enumerate(alternatives[:k - 1])]
                               if k else [])
        s.pending += 1
        events += self.outputs.accept(req, s.output, tok, False, s.position, lp, prompt_logprobs)
        s.position += 1

    def _prompt_logprobs(self, req: Request):
        """Made-up prompt logprobs in the engine's form, when the request asks for them."""
        k = req.params.prompt_logprobs
        if k is None or req.resume:
            return None
        prompt = req.prompt
        return [(prompt[0], None, None)] + [(t, -1.0, [(t, -1.0)] * min(k, 1)) for t in prompt[1:]]
