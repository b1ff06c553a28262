"""The engine's events as the Ingress receives them: one delivery of a stream's TokenEvents becomes Deltas (a
choice's consecutive tokens of one segment in one record), with logprobs as clients see them (token texts and
bytes), made here in the chat replica, where the tokenizer is."""
from __future__ import annotations

import math

from core.chat import ChatTokenizer
from core.chat.protocol import Delta, ShownLogprobs, ShownToken, TokenEvent


def shown_token(tok: ChatTokenizer, token_id: int, logprob: float | None) -> ShownToken:
    """A token as OpenAI's logprobs show it: its text, its UTF-8 bytes, its logprob. A special token shows its
    name and has no bytes; a token that is part of a multi-byte character shows U+FFFD and its own bytes."""
    raw = tok.token_bytes(token_id)
    text = raw.decode("utf-8", errors="replace") if raw or not tok.is_special(token_id) else tok.decode([token_id])
    # -inf (a token that cannot be drawn) as OpenAI shows it; JSON has no infinities
    return ShownToken(text, tuple(raw), logprob if logprob is None or math.isfinite(logprob) else -9999.0)


def prompt_entries(tok: ChatTokenizer, ev: TokenEvent, bos_added: bool) -> tuple[ShownLogprobs, ...]:
    """`ev`'s prompt logprobs as clients see them (token texts and bytes). `bos_added`: the prompt's <|bos|> was
    put there by this deployment, so it is not the client's: its entry goes, and the client's first token, like
    any prompt's first, shows no logprob."""
    entries = ev.prompt_logprobs[1:] if bos_added else ev.prompt_logprobs
    return tuple(ShownLogprobs(shown_token(tok, t, lp if i else None),
                               tuple(shown_token(tok, a, v) for a, v in top or ()) if i else ())
                 for i, (t, lp, top) in enumerate(entries))


class _Run:
    """A Delta being gathered: consecutive events of one choice in one segment."""

    __slots__ = ("index", "tokens", "text", "length", "segment", "closes", "finish", "prompt", "completion",
                 "cached", "logprobs", "offsets", "entries")

    def __init__(self, index: int, ev: TokenEvent):
        self.index, self.segment = index, ev.segment
        self.tokens: list[int] = []
        self.text: list[str] = []
        self.length = 0                     # characters in `text` that join the reply's text
        self.logprobs: list | None = None
        self.offsets: list[int] = []
        self.entries = None
        self.closes, self.finish = False, None

    def delta(self) -> Delta:
        return Delta(self.index, tuple(self.tokens), "".join(self.text), self.segment, self.closes, self.finish,
                     self.prompt, self.completion, self.cached,
                     tuple(self.logprobs) if self.logprobs is not None else None,
                     tuple(self.offsets) if self.logprobs is not None else None, self.entries)


def deltas(tok: ChatTokenizer, batch: list[TokenEvent], offset: int = 0, bos_added: bool = False) -> list[Delta]:
    """One delivery of a stream's events as Deltas: per choice (`offset` + the sample's index), a record for
    each run of events in one segment that no calculator part's end or sample's end breaks. Logprobs become
    what clients see (token texts and bytes) here, where the tokenizer is."""
    out: list[_Run] = []
    open_runs: dict[int, _Run] = {}
    for ev in batch:
        index = offset + ev.index
        run = open_runs.get(index)
        if run is None or run.segment != ev.segment:
            run = open_runs[index] = _Run(index, ev)
            out.append(run)
        if ev.token is not None:
            run.tokens.append(ev.token)
        run.prompt, run.completion, run.cached = ev.prompt_tokens, ev.completion_tokens, ev.cached_tokens
        if ev.logprob is not None:
            run.offsets.append(run.length)
            shown = ShownLogprobs(shown_token(tok, ev.token, ev.logprob),
                                  tuple(shown_token(tok, t, lp) for t, lp in ev.top_logprobs))
            if run.logprobs is None:
                run.logprobs = [shown]
            else:
                run.logprobs.append(shown)
        if ev.text:
            run.text.append(ev.text)
            if ev.segment == "text":        # a calculator part's text is not part of the reply's text
                run.length += len(ev.text)
        if ev.prompt_logprobs is not None:
            run.entries = prompt_entries(tok, ev, bos_added)
        if ev.closes or ev.finish_reason is not None:
            run.closes, run.finish = ev.closes, ev.finish_reason
            del open_runs[index]
    return [run.delta() for run in out]
