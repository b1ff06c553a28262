"""The output side of the chat engine: what each sampled (or forced) token means, with no model and no torch.

Per sample, `SampleOutput` holds the calculator state machine (text -> `<|python_start|>` call ->
`<|python_end|>`, whose result is queued as forced tokens -> `<|output_start|>` ... `<|output_end|>`), the
streaming text decoder, the tail of text held back because it may begin a stop string, and the finish
reason. `OutputProcessor.accept` takes one token of one sample and returns its events; `replay` feeds the
tokens of an earlier run through the same bookkeeping and keeps only a finish, which is how a continued
generation (`resume`) gets back to where that run stopped.

The engine owns the rest of a token's life (its row, the sampler's random stream, penalties); this unit is
driven by a tokenizer alone, so its tests need no model.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import msgspec

from .calculator import format_result, use_calculator
from .protocol import SamplingParams, TokenEvent
from .tokenizer import ChatTokenizer, StreamDecoder


@dataclass
class SampleOutput:
    index: int                       # the sample's index within its request
    decoder: StreamDecoder
    generated: list[int] = field(default_factory=list)   # every token accepted, forced ones included
    forced: deque = field(default_factory=deque)          # calculator tokens to feed before sampling again
    segment: str = "text"
    expr_tokens: list[int] = field(default_factory=list)  # the calculator call being written
    held: str = ""                   # text held back because it may begin a stop string
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class RequestView:
    """What the output side needs to know of a request."""

    id: str
    params: SamplingParams
    max_new: int                     # tokens it may generate (max_tokens, cut to the context)
    prompt_tokens: int
    cached_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: ChatTokenizer, sequence_len: int):
        self.tok, self.sequence_len = tokenizer, sequence_len
        t = tokenizer.encode_special
        self.python_start, self.python_end = t("<|python_start|>"), t("<|python_end|>")
        self.output_start, self.output_end = t("<|output_start|>"), t("<|output_end|>")
        self.stop_tokens = frozenset({t("<|assistant_end|>"), tokenizer.bos_id})

    def new_sample(self, index: int) -> SampleOutput:
        return SampleOutput(index, self.tok.stream_decoder())

    def accept(self, req: RequestView, s: SampleOutput, tok: int, forced: bool, position: int,
               lp=None, prompt_logprobs=None) -> list[TokenEvent]:
        """Token `tok` of sample `s`, whose row holds `position` tokens -> its events (a token, and a finish when
        it ends the sample). `lp`: its LogprobResult, when the request asked for logprobs; `prompt_logprobs`: the
        prompt's, which ride on the first event."""
        events = self._accept(req, s, tok, forced, position, lp)
        if prompt_logprobs is not None:
            events[0] = msgspec.structs.replace(events[0], prompt_logprobs=prompt_logprobs)
        return events

    def _accept(self, req: RequestView, s: SampleOutput, tok: int, forced: bool, position: int,
                lp=None) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        s.generated.append(tok)
        text, segment, closes = "", s.segment, False
        if tok in self.stop_tokens:
            if not req.params.ignore_eos:
                events.append(self.finish(req, s, "stop"))
                return events
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
                    events.append(self.finish(req, s, "stop", flush=False))
                    return events
            else:
                text = delta
        events.append(self._event(req, s, tok, text, segment, forced, closes=closes, lp=lp))
        if len(s.generated) >= req.max_new or position + 1 >= self.sequence_len:
            events.append(self.finish(req, s, "length"))
        return events

    def replay(self, req: RequestView, s: SampleOutput, tokens: list[int]) -> TokenEvent | None:
        """Feed the tokens an earlier run delivered, dropping their events (the client has them). A token that
        matches the calculator's queued result counts as forced; one that departs from it drops the queue (the
        client's tokens stand). -> the finish event if the replay ends the sample (a stop string), else None."""
        for tok in tokens:
            forced = bool(s.forced) and s.forced[0] == tok
            if forced:
                s.forced.popleft()
            else:
                s.forced.clear()
            events = self._accept(req, s, tok, forced, 0)
            if s.finish_reason:
                return events[-1]
        return None

    def finish(self, req: RequestView, s: SampleOutput, reason: str, flush: bool = True) -> TokenEvent:
        """End sample `s`; its last event carries any text still held (unless `flush` is off: a stop string)."""
        tail = self._flush_text(s) if flush else ""
        s.finish_reason = reason
        return self._event(req, s, None, tail, s.segment if tail else "text", False, reason)

    def fail(self, req: RequestView, s: SampleOutput, reason: str) -> TokenEvent:
        """End sample `s` at once, dropping any held text (a fault, not a normal end)."""
        s.held = ""
        s.finish_reason = reason
        return self._event(req, s, None, "", "text", False, reason)

    @staticmethod
    def _check_stop(s: SampleOutput, delta: str, stops: tuple[str, ...]) -> tuple[str, bool]:
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
    def _flush_text(s: SampleOutput) -> str:
        text = s.held + s.decoder.flush()
        s.held = ""
        return text

    @staticmethod
    def _event(req: RequestView, s: SampleOutput, tok, text, segment, forced, finish=None, closes=False,
               lp=None) -> TokenEvent:
        return TokenEvent(req.id, s.index, tok, text, segment, forced, closes, finish, req.prompt_tokens,
                          len(s.generated), req.cached_tokens, lp.logprob if lp else None, lp.top if lp else None)
