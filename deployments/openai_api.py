"""OpenAI chat and text completions: request models and response shaping (the HTTP boundary, pydantic)."""
from __future__ import annotations

import json
import time
import uuid
from itertools import accumulate
from typing import Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from core.chat.grammars import (GrammarError, ToolCallReader, ToolFormat, ToolPlan, response_format_grammar,
                                structured_outputs_grammar, tool_plan, tools_text)
from core.chat.protocol import (MAX_LOGIT_BIAS, MAX_PENALTY, MAX_REPETITION_PENALTY, MAX_STOP, MAX_TEMPERATURE,
                                MAX_TOP_LOGPROBS, MIN_REPETITION_PENALTY, Delta, SamplingDefaults, SamplingParams,
                                ShownLogprobs, ShownToken)


class ContentPart(BaseModel):
    """A text part (OpenAI), or one of nanochat's calculator parts in an assistant turn."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "python", "python_output"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str = "{}"       # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    parts: list[ContentPart] | None = None     # our extension: an assistant reply with its calculator calls
    tool_calls: list[ToolCall] | None = None   # an assistant turn's function calls
    tool_call_id: str | None = None            # a tool message: the call it answers
    name: str | None = None

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def for_prompter(self) -> dict:
        role = "system" if self.role == "developer" else self.role
        if self.parts is not None and role == "assistant":
            out = {"role": role, "content": [p.model_dump() for p in self.parts]}
        elif isinstance(self.content, list):
            out = {"role": role, "content": [p.model_dump() for p in self.content]}
        else:
            out = {"role": role, "content": self.content or ""}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if role == "tool":
            out["tool_call_id"] = self.tool_call_id
            if self.name:
                out["name"] = self.name
        return out


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None      # a JSON schema of the arguments object; enforced by the grammar
    strict: bool | None = None          # accepted: the arguments always follow `parameters` here


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


# Parameters of OpenAI's API that change what is generated and that this service does not implement: a request
# that sends one gets a 400 naming it, never a reply that silently differs from what it asked for.
UNSUPPORTED = {
    "functions": "the deprecated function definitions: send `tools`",
    "function_call": "the deprecated function calls: send `tools` and `tool_choice`", "audio": "audio output", "modalities": "output modalities",
    "prediction": "predicted outputs", "web_search_options": "web search", "reasoning_effort": "reasoning effort",
    "verbosity": "verbosity", "suffix": "suffix insertion", "best_of": "best_of",
    **{f"guided_{k}": f"vLLM's retired guided_{k}: send structured_outputs {{\"{k}\": ...}}"
       for k in ("json", "regex", "choice", "grammar")},
}


def unsupported(data: dict) -> tuple[str, str] | None:
    """The first parameter in a request body that is not supported, with what it asks for; None when all are."""
    for name, what in UNSUPPORTED.items():
        if name in data and data[name] is not None:
            if name == "best_of" and data[name] in (1, data.get("n", 1)):
                continue            # best_of equal to n is plain sampling
            return name, what
    return None


def prompt_messages(messages: list[Message], tools: list[Tool] | None, fmt: ToolFormat | None) -> tuple[dict, ...]:
    """A conversation for the prompter; with tools, a system message that describes them (and how to call them in
    the format `fmt`) comes first."""
    out = tuple(m.for_prompter() for m in messages)
    if tools:
        out = ({"role": "system", "content": tools_text([t.model_dump() for t in tools], fmt)},) + out
    return out


class SamplingFields(BaseModel):
    """The sampling parameters chat and text completions share."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False     # vLLM's extension: always generate max_tokens (fixed-length benchmarks)
    presence_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float = Field(default=1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)   # vLLM's
    logit_bias: dict[int, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    response_format: dict | None = None        # text, json_object or json_schema (grammars.py)
    structured_outputs: dict | None = None     # vLLM's: json, regex, choice, grammar or json_object (grammars.py)
    best_of: int | None = None                 # only equal to n (checked by `unsupported`)
    # accepted, and without effect on generation (bookkeeping fields of OpenAI's API)
    user: str | None = None
    metadata: dict | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return []
        v = [v] if isinstance(v, str) else v
        if len(v) > MAX_STOP or any(not s for s in v):
            raise ValueError(f"stop takes up to {MAX_STOP} non-empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for tok, bias in (v or {}).items():
            if tok < 0:
                raise ValueError(f"logit_bias keys are token ids, got {tok}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {tok}")
        return v

    def format_grammar(self) -> str | None:
        """The grammar the reply's format asks for: `response_format`'s or `structured_outputs`' (not both)."""
        a = response_format_grammar(self.response_format)
        b = structured_outputs_grammar(self.structured_outputs)
        if a is not None and b is not None:
            raise GrammarError("response_format and structured_outputs both constrain the reply: send one",
                               "structured_outputs")
        return a if b is None else b

    def _params(self, max_tokens: int | None, logprobs: int | None, defaults: SamplingDefaults,
                grammar: str | None = None) -> SamplingParams:
        """The request's SamplingParams, the checkpoint's `defaults` where it leaves a value out (SamplingError
        for a value out of range, GrammarError for a structured output that cannot be enforced); `grammar`: the
        tools' grammar, else the response_format's."""
        pick = lambda value, default: default if value is None else value   # noqa: E731
        grammar = self.format_grammar() if grammar is None else grammar
        return SamplingParams(
            max_tokens=max_tokens or defaults.max_tokens, temperature=pick(self.temperature, defaults.temperature),
            top_k=pick(self.top_k, defaults.top_k), top_p=pick(self.top_p, defaults.top_p), seed=self.seed,
            n=self.n, stop=tuple(self.stop or ()), ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=dict(self.logit_bias or {}), logprobs=logprobs,
            grammar=grammar)


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    _plan: ToolPlan | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _checks(self):
        if self.max_tokens and self.max_completion_tokens and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.tool_choice is not None and not self.tools and self.tool_choice != "none":
            raise ValueError("tool_choice needs tools")
        return self

    def tool_plan(self, fmt: ToolFormat | None = None) -> ToolPlan | None:
        """How the tools are used by a model with the tool-call format `fmt` (None without tools), worked out once;
        GrammarError for a choice that cannot be served."""
        if not self.tools:
            return None
        if self._plan is None:
            plan = tool_plan([t.model_dump() for t in self.tools], self.tool_choice, self.parallel_tool_calls, fmt)
            if plan.grammar is not None and self.format_grammar() is not None:
                field = "response_format" if self.response_format else "structured_outputs"
                raise GrammarError(f"a reply is either tool calls or a {field}, not both: send one", field)
            self._plan = plan
        return self._plan

    def prompt_messages(self, fmt: ToolFormat | None = None) -> tuple[dict, ...]:
        return prompt_messages(self.messages, self.tools, fmt)

    def to_params(self, defaults: SamplingDefaults, fmt: ToolFormat | None = None) -> SamplingParams:
        plan = self.tool_plan(fmt)
        return self._params(self.max_completion_tokens or self.max_tokens,
                            (self.top_logprobs or 0) if self.logprobs else None, defaults,
                            plan.grammar if plan else None)


class TextCompletionRequest(SamplingFields):
    """OpenAI's legacy completions: a raw prompt, no chat template."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=0)      # 0 only with echo: the prompt scored, nothing generated
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False

    @model_validator(mode="after")
    def _checks(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing: send echo true to score the prompt")
        if any(isinstance(x, list) and not x for x in self.prompt):
            raise ValueError("a token-id prompt must not be empty")
        if any(isinstance(x, int) and x < 0 for x in self.prompt) or any(
                isinstance(x, list) and min(x) < 0 for x in self.prompt):
            raise ValueError("token ids are not negative")
        return self

    def prompts(self) -> list:
        """The prompt as a list of prompts, each text or token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or all(isinstance(x, int) for x in p) else list(p)

    def to_params(self, defaults: SamplingDefaults) -> SamplingParams:
        params = self._params(self.max_tokens, self.logprobs, defaults)
        if self.echo and (self.logprobs is not None or self.max_tokens == 0):   # the prompt's logprobs, echoed
            params = msgspec.structs.replace(params, prompt_logprobs=self.logprobs or 0, max_tokens=self.max_tokens)
        return params


def _token_entry(t: ShownToken) -> dict:
    return {"token": t.token, "bytes": list(t.bytes), "logprob": t.logprob}


def logprob_entry(lp: ShownLogprobs) -> dict:
    """A sampled token's logprobs in OpenAI's chat shape."""
    return _token_entry(lp.chosen) | {"top_logprobs": [_token_entry(t) for t in lp.top]}


class Completion:
    """Accumulates engine events into OpenAI's chat chunk and completion objects. With several prompts (text
    completions), choice i belongs to prompt i // n."""

    prefix, chunk_object, object = "chatcmpl", "chat.completion.chunk", "chat.completion"

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

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def _choice_chunk(self, i: int, content: str | None = None, parts: list | None = None,
                      finish: str | None = None, tool_calls: list | None = None) -> dict:
        delta = {}
        if content is not None:
            delta["content"] = content
        if parts is not None:
            delta["parts"] = parts
        if tool_calls is not None:
            delta["tool_calls"] = tool_calls
        choice = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": None}
        if self.want_logprobs and self.unsent[i]:
            choice["logprobs"] = {"content": self.unsent[i], "refusal": None}
            self.unsent[i] = []
        return self._chunk([choice])

    def usage(self) -> dict:
        p, c = sum(self.prompt_tokens), sum(self.completion_tokens)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)}}

    def _add_part(self, i: int, kind: str, text: str) -> None:
        parts = self.parts[i]
        if parts and parts[-1]["type"] == kind == "text":
            parts[-1]["text"] += text
        elif text or kind != "text":
            parts.append({"type": kind, "text": text})

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

    def _call_delta(self, i: int, k: int, name: str | None, arguments: str) -> dict:
        """OpenAI's streamed tool-call delta: the first of a call has its id, type and name."""
        if name is None:
            return {"index": k, "function": {"arguments": arguments}}
        return {"index": k, "id": self._call_id(i, k), "type": "function",
                "function": {"name": name, "arguments": arguments}}

    def tool_calls(self, i: int) -> list[dict]:
        return [{"id": self._call_id(i, k), "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}}
                for k, c in enumerate(self.readers[i].calls)]

    def _end_segment(self, i: int) -> list[dict]:
        kind, text = self.segment_kind[i], self.segment_text[i]
        self.segment_kind[i], self.segment_text[i] = None, ""
        self._add_part(i, kind, text)
        return [self._choice_chunk(i, parts=[{"type": kind, "text": text}])]

    def first_chunks(self) -> list[dict]:
        content = "" if self.may_write_text else None
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": content}, "finish_reason": None,
                              "logprobs": None}]) for i in range(len(self.text))]

    def usage_chunk(self) -> dict:
        return self._chunk([], self.usage())

    # how generation.events writes a stream of these chunks
    done = "data: [DONE]\n\n"

    def last_chunks(self, include_usage: bool) -> list[dict]:
        return [self.usage_chunk()] if include_usage else []

    @staticmethod
    def error_chunk(body: dict) -> dict:
        return body

    @staticmethod
    def encode(chunk: dict) -> str:
        return sse(chunk)

    def response(self) -> dict:
        choices = []
        for i, text in enumerate(self.text):
            msg = {"role": "assistant", "content": text, "refusal": None}
            if self.readers is not None:
                calls = self.tool_calls(i)
                msg["content"] = self.readers[i].content or None
                if calls or self.readers[i].format is None:
                    msg["tool_calls"] = calls
                elif not msg["content"]:
                    msg["content"] = ""
            if any(p["type"] != "text" for p in self.parts[i]):
                msg["parts"] = self.parts[i]
            choice = {"index": i, "message": msg, "finish_reason": self.finish[i] or "stop",
                      "logprobs": {"content": self.logprobs[i], "refusal": None} if self.want_logprobs else None}
            choices.append(choice)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}


class TextCompletion(Completion):
    """The same accumulation in the shapes of OpenAI's legacy completions (`text`, legacy `logprobs`). With
    `echo`, each choice's text starts with its prompt's text."""

    prefix, chunk_object, object = "cmpl", "text_completion", "text_completion"

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

    def _legacy(self, i: int, entries: list[dict]) -> dict:
        offsets = self.offsets[i][len(self.offsets[i]) - len(entries):]
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}

    @staticmethod
    def _prompt_legacy(entries) -> dict:
        """A prompt's scored tokens in the legacy shape: the first has no logprob and no alternatives (null)."""
        offsets = list(accumulate((len(e.chosen.token) for e in entries[:-1]), initial=0)) if entries else []
        return {"tokens": [e.chosen.token for e in entries], "token_logprobs": [e.chosen.logprob for e in entries],
                "top_logprobs": [{t.token: t.logprob for t in e.top} if e.chosen.logprob is not None else None
                                 for e in entries], "text_offset": offsets}

    def feed(self, ev: Delta) -> list[dict]:
        chunks = []
        if self.scored and ev.prompt_entries is not None:
            p = ev.index // self.n
            self.prompt_legacy[p] = legacy = self._prompt_legacy(ev.prompt_entries)
            chunks = [self._chunk([{"index": i, "text": self.echo[p], "logprobs": legacy, "finish_reason": None}])
                      for i in range(p * self.n, (p + 1) * self.n)]
        return chunks + super().feed(ev)

    def _choice_chunk(self, i: int, content: str | None = None, parts: list | None = None,
                      finish: str | None = None) -> dict:
        choice = {"index": i, "text": content or "", "logprobs": None, "finish_reason": finish}
        if parts is not None:
            choice["parts"] = parts
        if self.want_logprobs:
            choice["logprobs"] = self._legacy(i, self.unsent[i])
            self.unsent[i] = []
        return self._chunk([choice])

    def first_chunks(self) -> list[dict]:
        if not self.echo or self.scored:
            return []
        return [self._chunk([{"index": i, "text": self.echo[i // self.n], "logprobs": None, "finish_reason": None}])
                for i in range(len(self.text))]

    def response(self) -> dict:
        choices = []
        for i, text in enumerate(self.text):
            logprobs = self._legacy(i, self.logprobs[i]) if self.want_logprobs else None
            if logprobs is not None and self.prompt_legacy[i // self.n] is not None:
                logprobs = {k: v + logprobs[k] for k, v in self.prompt_legacy[i // self.n].items()}
            choice = {"index": i, "text": (self.echo[i // self.n] if self.echo else "") + text,
                      "logprobs": logprobs, "finish_reason": self.finish[i] or "stop"}
            if any(p["type"] != "text" for p in self.parts[i]):
                choice["parts"] = self.parts[i]
            choices.append(choice)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ---- response shapes, for the published OpenAPI schema (the handlers build these as plain dicts)

class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class LogprobEntry(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[LogprobEntry] | None = None
    refusal: list[LogprobEntry] | None = None    # always null: the models here do not refuse


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None                         # null when the reply is tool calls
    refusal: None = None                        # OpenAI's field: these models never refuse
    tool_calls: list[ToolCall] | None = None    # with tools and tool_choice "required" or a named function
    parts: list[ContentPart] | None = None     # the reply in order, calculator calls and results included


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None             # null unless the request asked for logprobs


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatCompletionResponse(BaseModel):
    """Without `stream`; with it, `text/event-stream` of `chat.completion.chunk` objects, then `data: [DONE]`."""
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage


class LegacyLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]          # with echo, the prompt's first token has none
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TextChoice(BaseModel):
    index: int
    text: str
    logprobs: LegacyLogprobs | None = None
    finish_reason: Literal["stop", "length"]
    parts: list[ContentPart] | None = None


class TextCompletionResponse(BaseModel):
    """Without `stream`; with it, `text/event-stream` of `text_completion` chunks, then `data: [DONE]`."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: CompletionUsage


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a `prompt` (a completion's text), or `messages` under the chat template (with `tools`
    described as a chat request would describe them)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = None     # prompt: <|bos|> first (default true); messages: the template's
    add_generation_prompt: bool = True         # messages: end with <|assistant_start|>, as a request's prompt does
    continue_final_message: bool = False
    return_token_strs: bool = False

    def prompt_messages(self, fmt: ToolFormat | None = None) -> tuple[dict, ...]:
        return prompt_messages(self.messages, self.tools, fmt)

    @model_validator(mode="after")
    def _checks(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        if self.tools and self.messages is None:
            raise ValueError("tools are described in a chat template: send messages")
        if self.continue_final_message:
            raise ValueError("continue_final_message is not supported: the chat template always ends a message")
        if self.messages is not None and self.add_special_tokens is False:
            raise ValueError("the chat template always starts with <|bos|>: add_special_tokens false applies to "
                             "a prompt only")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None        # each token's text (a special token's name)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int                                # the checkpoint's time (its config file's modification time)
    owned_by: str
    kind: Literal["chat", "decision"]
    alias_of: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    errors: dict[str, str] | None = None        # /v1/systemone: every bad question by name


class ErrorResponse(BaseModel):
    error: ErrorDetail
