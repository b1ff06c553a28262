"""Per-stream accumulators: the chat stream's Deltas into OpenAI's chunks and the whole response, chat
(`Completion`) or legacy text (`TextCompletion`), each built from its shape in openai_shapes.py. With several
prompts (text completions), choice i belongs to prompt i // n."""
from __future__ import annotations

import time
import uuid
from itertools import accumulate

import msgspec

from core.chat.grammars import ToolCallReader, ToolPlan
from core.chat.protocol import Delta, ShownLogprobs, ShownToken

from .openai_shapes import (AssistantMessage, AssistantToolCall, CalledFunction, ChatChoice, ChatCompletionChunk,
                            ChatCompletionResponse, ChoiceLogprobs, ChunkChoice, ChunkDelta, CompletionUsage,
                            FunctionDelta, LegacyLogprobs, LogprobEntry, OutputPart, PromptTokensDetails,
                            TextChoice, TextCompletionChunk, TextCompletionResponse, TokenLogprob, ToolCallDelta)


def _token_entry(t: ShownToken) -> TokenLogprob:
    return TokenLogprob(token=t.token, logprob=t.logprob, bytes=list(t.bytes))


def logprob_entry(lp: ShownLogprobs) -> LogprobEntry:
    """A sampled token's logprobs in OpenAI's chat shape."""
    t = lp.chosen
    return LogprobEntry(token=t.token, logprob=t.logprob, bytes=list(t.bytes),
                        top_logprobs=[_token_entry(t) for t in lp.top])


class Completion:
    """Accumulates engine events into OpenAI's chat chunk and completion objects. With several prompts (text
    completions), choice i belongs to prompt i // n."""

    prefix, chunk_object, object = "chatcmpl", "chat.completion.chunk", "chat.completion"
    chunk_shape = ChatCompletionChunk

    def __init__(self, model: str, n: int, prompts: int = 1, logprobs: bool = False, tools: ToolPlan | None = None):
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.n = n
        choices = n * prompts
        self.text = [""] * choices
        self.parts: list[list[dict]] = [[] for _ in range(choices)]
        self.segment_text = [""] * choices
        self.segment_kind: list[str | None] = [None] * choices
        self.finish = [None] * choices
        self.prompt_tokens = [0] * prompts
        self.cached_tokens = [0] * prompts
        self.completion_tokens = [0] * choices
        self.want_logprobs = logprobs
        self.logprobs: list[list[dict]] = [[] for _ in range(choices)]     # every entry so far
        self.unsent: list[list[dict]] = [[] for _ in range(choices)]       # entries no chunk has carried yet
        # with tools that may be called, the text is read as tool calls (and, in a checkpoint's tool-call format,
        # the content before them)
        self.readers = [ToolCallReader(tools) for _ in range(choices)] if tools and tools.grammar else None
        self.may_write_text = self.readers is None or tools.mode == "auto"     # else the reply is calls only

    def _chunk(self, choices: list, usage: CompletionUsage | None = None) -> ChatCompletionChunk:
        out = self.chunk_shape(id=self.id, object=self.chunk_object, created=self.created, model=self.model,
                               choices=choices)
        if usage is not None:
            out["usage"] = usage
        return out

    def _choice_chunk(self, i: int, content: str | None = None, parts: list | None = None,
                      finish: str | None = None, tool_calls: list | None = None) -> ChatCompletionChunk:
        delta = ChunkDelta()
        if content is not None:
            delta["content"] = content
        if parts is not None:
            delta["parts"] = parts
        if tool_calls is not None:
            delta["tool_calls"] = tool_calls
        choice = ChunkChoice(index=i, delta=delta, finish_reason=finish, logprobs=None)
        if self.want_logprobs and self.unsent[i]:
            choice["logprobs"] = ChoiceLogprobs(content=self.unsent[i], refusal=None)
            self.unsent[i] = []
        return self._chunk([choice])

    def usage(self) -> CompletionUsage:
        p, c = sum(self.prompt_tokens), sum(self.completion_tokens)
        return CompletionUsage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                               prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached_tokens)))

    def _add_part(self, i: int, kind: str, text: str) -> None:
        parts = self.parts[i]
        if parts and parts[-1]["type"] == kind == "text":
            parts[-1]["text"] += text
        elif text or kind != "text":
            parts.append(OutputPart(type=kind, text=text))

    def _record_logprob(self, i: int, entry: dict, offset: int) -> None:
        """A sampled token's entry; `offset`: where its text starts in the text its record brings."""
        self.logprobs[i].append(entry)
        self.unsent[i].append(entry)

    def feed(self, ev: Delta) -> list[dict]:
        """One record of the chat stream -> the stream chunks it produces (possibly none). Text streams as
        `content`, a record's text in one chunk; a calculator call or its output is sent whole, as one `parts`
        delta, when it closes. Sampled tokens' logprob entries ride on the next chunk of their choice."""
        i = ev.index
        self.prompt_tokens[i // self.n] = ev.prompt_tokens
        self.cached_tokens[i // self.n] = ev.cached_tokens
        self.completion_tokens[i] = max(self.completion_tokens[i], ev.completion_tokens)
        if ev.logprobs is not None:
            for lp, offset in zip(ev.logprobs, ev.logprob_offsets):
                self._record_logprob(i, logprob_entry(lp), offset)
        chunks = []
        if self.readers is not None:
            self.text[i] += ev.text
            reader = self.readers[i]
            deltas = reader.feed(ev.text)
            if ev.finish_reason:
                reader.finish()
            content = reader.take_content() or None
            if deltas or content or self.unsent[i]:
                chunks.append(self._choice_chunk(i, content=content,
                                                 tool_calls=[self._call_delta(i, *d) for d in deltas] or None))
        elif ev.segment == "text":
            if ev.text:
                self.text[i] += ev.text
                self._add_part(i, "text", ev.text)
                chunks.append(self._choice_chunk(i, content=ev.text))
        else:
            self.segment_text[i] += ev.text
            self.segment_kind[i] = ev.segment
            if ev.closes:
                chunks += self._end_segment(i)
        if ev.finish_reason:
            if self.segment_kind[i]:       # cut off inside a calculator call
                chunks += self._end_segment(i)
            complete_calls = self.readers is not None and self.readers[i].complete   # not cut by a stop string
            self.finish[i] = ("length" if ev.finish_reason == "length" else "tool_calls" if complete_calls else "stop")
            chunks.append(self._choice_chunk(i, finish=self.finish[i]))
        return chunks

    def _call_id(self, i: int, k: int) -> str:
        return f"call_{self.id.rsplit('-', 1)[-1][:16]}_{i}_{k}"

    def _call_delta(self, i: int, k: int, name: str | None, arguments: str) -> ToolCallDelta:
        """OpenAI's streamed tool-call delta: the first of a call has its id, type and name."""
        if name is None:
            return ToolCallDelta(index=k, function=FunctionDelta(arguments=arguments))
        return ToolCallDelta(index=k, id=self._call_id(i, k), type="function",
                             function=FunctionDelta(name=name, arguments=arguments))

    def tool_calls(self, i: int) -> list[AssistantToolCall]:
        return [AssistantToolCall(id=self._call_id(i, k), type="function",
                                  function=CalledFunction(name=c["name"], arguments=c["arguments"]))
                for k, c in enumerate(self.readers[i].calls)]

    def _end_segment(self, i: int) -> list[dict]:
        kind, text = self.segment_kind[i], self.segment_text[i]
        self.segment_kind[i], self.segment_text[i] = None, ""
        self._add_part(i, kind, text)
        return [self._choice_chunk(i, parts=[OutputPart(type=kind, text=text)])]

    def first_chunks(self) -> list[dict]:
        content = "" if self.may_write_text else None
        return [self._chunk([ChunkChoice(index=i, delta=ChunkDelta(role="assistant", content=content),
                                         finish_reason=None, logprobs=None)]) for i in range(len(self.text))]

    def usage_chunk(self) -> dict:
        return self._chunk([], self.usage())

    # how generation.events writes a stream of these chunks
    done = "data: [DONE]\n\n"

    @property
    def finished(self) -> bool:
        """Every choice has its finish reason (only the closing chunks are left)."""
        return all(f is not None for f in self.finish)

    def last_chunks(self, include_usage: bool) -> list[dict]:
        return [self.usage_chunk()] if include_usage else []

    @staticmethod
    def error_chunk(body: dict) -> dict:
        return body

    @staticmethod
    def encode(chunk: dict) -> str:
        return sse(chunk)

    def response(self) -> ChatCompletionResponse:
        choices = []
        for i, text in enumerate(self.text):
            msg = AssistantMessage(role="assistant", content=text, refusal=None)
            if self.readers is not None:
                calls = self.tool_calls(i)
                msg["content"] = self.readers[i].content or None
                if calls or self.readers[i].format is None:
                    msg["tool_calls"] = calls
                elif not msg["content"]:
                    msg["content"] = ""
            if any(p["type"] != "text" for p in self.parts[i]):
                msg["parts"] = self.parts[i]
            choices.append(ChatChoice(index=i, message=msg, finish_reason=self.finish[i] or "stop",
                                      logprobs=ChoiceLogprobs(content=self.logprobs[i], refusal=None)
                                      if self.want_logprobs else None))
        return ChatCompletionResponse(id=self.id, object=self.object, created=self.created, model=self.model,
                                      choices=choices, usage=self.usage())


class TextCompletion(Completion):
    """The same accumulation in the shapes of OpenAI's legacy completions (`text`, legacy `logprobs`). With
    `echo`, each choice's text starts with its prompt's text."""

    prefix, chunk_object, object = "cmpl", "text_completion", "text_completion"
    chunk_shape = TextCompletionChunk

    def __init__(self, model: str, n: int, prompts: int = 1, logprobs: bool = False,
                 echo: list[str] | None = None):
        super().__init__(model, n, prompts, logprobs)
        self.echo = echo
        self.offsets: list[list[int]] = [[] for _ in self.text]      # text offset of each logprob entry
        # with echo and logprobs, each prompt's tokens are scored too: the echo waits for them (they ride on
        # its chunk) and they lead each choice's logprobs
        self.scored = bool(echo) and logprobs
        self.prompt_legacy: list[dict | None] = [None] * prompts

    def _record_logprob(self, i: int, entry: dict, offset: int) -> None:
        super()._record_logprob(i, entry, offset)
        self.offsets[i].append((len(self.echo[i // self.n]) if self.echo else 0) + len(self.text[i]) + offset)

    def _legacy(self, i: int, entries: list[LogprobEntry]) -> LegacyLogprobs:
        offsets = self.offsets[i][len(self.offsets[i]) - len(entries):]
        return LegacyLogprobs(tokens=[e["token"] for e in entries], token_logprobs=[e["logprob"] for e in entries],
                              top_logprobs=[{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                              text_offset=offsets)

    @staticmethod
    def _prompt_legacy(entries) -> LegacyLogprobs:
        """A prompt's scored tokens in the legacy shape: the first has no logprob and no alternatives (null)."""
        offsets = list(accumulate((len(e.chosen.token) for e in entries[:-1]), initial=0)) if entries else []
        return LegacyLogprobs(tokens=[e.chosen.token for e in entries],
                              token_logprobs=[e.chosen.logprob for e in entries],
                              top_logprobs=[{t.token: t.logprob for t in e.top} if e.chosen.logprob is not None
                                            else None for e in entries], text_offset=offsets)

    def feed(self, ev: Delta) -> list[dict]:
        chunks = []
        if self.scored and ev.prompt_entries is not None:
            p = ev.index // self.n
            self.prompt_legacy[p] = legacy = self._prompt_legacy(ev.prompt_entries)
            chunks = [self._chunk([TextChoice(index=i, text=self.echo[p], logprobs=legacy, finish_reason=None)])
                      for i in range(p * self.n, (p + 1) * self.n)]
        return chunks + super().feed(ev)

    def _choice_chunk(self, i: int, content: str | None = None, parts: list | None = None,
                      finish: str | None = None) -> TextCompletionChunk:
        choice = TextChoice(index=i, text=content or "", logprobs=None, finish_reason=finish)
        if parts is not None:
            choice["parts"] = parts
        if self.want_logprobs:
            choice["logprobs"] = self._legacy(i, self.unsent[i])
            self.unsent[i] = []
        return self._chunk([choice])

    def first_chunks(self) -> list[dict]:
        if not self.echo or self.scored:
            return []
        return [self._chunk([TextChoice(index=i, text=self.echo[i // self.n], logprobs=None, finish_reason=None)])
                for i in range(len(self.text))]

    def response(self) -> TextCompletionResponse:
        choices = []
        for i, text in enumerate(self.text):
            logprobs = self._legacy(i, self.logprobs[i]) if self.want_logprobs else None
            if logprobs is not None and self.prompt_legacy[i // self.n] is not None:
                logprobs = LegacyLogprobs(**{k: v + logprobs[k] for k, v in self.prompt_legacy[i // self.n].items()})
            choice = TextChoice(index=i, text=(self.echo[i // self.n] if self.echo else "") + text,
                                logprobs=logprobs, finish_reason=self.finish[i] or "stop")
            if any(p["type"] != "text" for p in self.parts[i]):
                choice["parts"] = self.parts[i]
            choices.append(choice)
        return TextCompletionResponse(id=self.id, object=self.object, created=self.created, model=self.model,
                                      choices=choices, usage=self.usage())


_JSON = msgspec.json.Encoder()


def sse(obj) -> str:
    """One server-sent event of `obj` as compact JSON (msgspec's encoder: a tenth of json.dumps's time per
    chunk, on the per-message path)."""
    return f"data: {_JSON.encode(obj).decode()}\n\n"
