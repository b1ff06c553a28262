"""OpenAI's request bodies (chat and text completions, vLLM's /tokenize and /detokenize), each with its checks
against the model's and the Ingress's limits and its SamplingParams.

A sampling value is checked once, by `SamplingParams` (core/chat/protocol.py), which names the field; the fields
here only state its range for the published schema (`limit`). Structured outputs are checked as grammars
(core/chat/grammars.py); a value out of a limit is an APIError naming its field.
"""
from __future__ import annotations

from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from core.chat.grammars import GrammarError, ToolPlan, response_format_grammar, structured_outputs_grammar, tool_plan
from core.chat.protocol import (MAX_LOGIT_BIAS, MAX_PENALTY, MAX_REPETITION_PENALTY, MAX_STOP, MAX_TEMPERATURE,
                                MAX_TOP_LOGPROBS, MIN_REPETITION_PENALTY, ChatModelInfo, SamplingDefaults,
                                SamplingParams, ToolFormat)

from .errors import APIError, error
from .openai_messages import Message, Tool, check_messages, prompt_messages
from .settings import IngressSettings


def limit(default: Any = None, **schema) -> Any:
    """A sampling field whose range the published schema states and SamplingParams checks."""
    return Field(default=default, json_schema_extra=schema)


# Parameters of OpenAI's API that change what is generated and that this service does not implement: a request
# that sends one gets a 400 naming it, never a reply that silently differs from what it asked for.
UNSUPPORTED = {
    "functions": "the deprecated function definitions: send `tools`",
    "function_call": "the deprecated function calls: send `tools` and `tool_choice`", "audio": "audio output",
    "modalities": "output modalities", "prediction": "predicted outputs", "web_search_options": "web search",
    "reasoning_effort": "reasoning effort", "verbosity": "verbosity", "suffix": "suffix insertion",
    "best_of": "best_of",
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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The sampling parameters chat and text completions share."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = limit(minimum=0.0, maximum=MAX_TEMPERATURE)
    top_p: float | None = limit(exclusiveMinimum=0.0, maximum=1.0)
    top_k: int | None = limit(minimum=0)
    n: int = limit(1, minimum=1)
    seed: int | None = None
    stop: str | list[str] | None = limit(maxItems=MAX_STOP)
    ignore_eos: bool = False     # vLLM's extension: always generate max_tokens (fixed-length benchmarks)
    presence_penalty: float = limit(0.0, minimum=-MAX_PENALTY, maximum=MAX_PENALTY)
    frequency_penalty: float = limit(0.0, minimum=-MAX_PENALTY, maximum=MAX_PENALTY)
    repetition_penalty: float = limit(1.0, minimum=MIN_REPETITION_PENALTY, maximum=MAX_REPETITION_PENALTY)  # vLLM's
    logit_bias: dict[int, float] | None = limit(maxProperties=MAX_LOGIT_BIAS)   # token id -> bias in [-100, 100]
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

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def has_grammar(self) -> bool:
        """Whether the request's SamplingParams compile a grammar (to_params then runs on a worker thread)."""
        return self.response_format is not None or self.structured_outputs is not None

    def format_grammar(self) -> str | None:
        """The grammar the reply's format asks for: `response_format`'s or `structured_outputs`' (not both)."""
        a = response_format_grammar(self.response_format)
        b = structured_outputs_grammar(self.structured_outputs)
        if a is not None and b is not None:
            raise GrammarError("response_format and structured_outputs both constrain the reply: send one",
                               "structured_outputs")
        return a if b is None else b

    def _check_length(self, max_tokens: int | None, info: ChatModelInfo) -> None:
        if max_tokens is not None and max_tokens >= info.sequence_len:
            raise APIError(error(f"max_tokens must be below the model's context of {info.sequence_len} tokens",
                                 param="max_tokens"))

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
            n=self.n, stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias=dict(self.logit_bias or {}), logprobs=logprobs, grammar=grammar)


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = limit(minimum=0, maximum=MAX_TOP_LOGPROBS)
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

    @property
    def has_grammar(self) -> bool:
        return bool(self.tools) or super().has_grammar

    def check(self, info: ChatModelInfo, limits: IngressSettings) -> None:
        """The model's and the Ingress's limits (an APIError naming the field)."""
        check_messages(self.messages, limits)
        if self.n > min(limits.max_n, info.max_n):
            raise APIError(error(f"n must be at most {min(limits.max_n, info.max_n)}", param="n"))
        self._check_length(self.max_completion_tokens or self.max_tokens, info)

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

    def to_params(self, info: ChatModelInfo) -> SamplingParams:
        plan = self.tool_plan(info.tool_format)
        return self._params(self.max_completion_tokens or self.max_tokens,
                            (self.top_logprobs or 0) if self.logprobs else None, info.sampling_defaults,
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

    def check(self, info: ChatModelInfo, limits: IngressSettings) -> None:
        """The model's and the Ingress's limits (an APIError naming the field)."""
        prompts = self.prompts()
        max_n, chars = min(limits.max_n, info.max_n), limits.max_message_chars
        if len(prompts) * self.n > max_n:
            raise APIError(error(f"prompts x n must be at most {max_n}", param="n"))
        for i, p in enumerate(prompts):
            if not isinstance(p, str) and max(p) >= info.vocab_size:    # before the echo decodes them
                raise APIError(error(f"prompt {i}: token ids must be below the vocabulary size {info.vocab_size}",
                                     param="prompt"))
            if len(p) > chars:
                raise APIError(error(f"prompt {i} has {len(p)} {'characters' if isinstance(p, str) else 'tokens'}; "
                                     f"the limit is {chars}", param="prompt"))
        self._check_length(self.max_tokens, info)

    def to_params(self, info: ChatModelInfo) -> SamplingParams:
        params = self._params(self.max_tokens, self.logprobs, info.sampling_defaults)
        if self.echo and (self.logprobs is not None or self.max_tokens == 0):   # the prompt's logprobs, echoed
            params = msgspec.structs.replace(params, prompt_logprobs=self.logprobs or 0, max_tokens=self.max_tokens)
        return params


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

    def check(self, info: ChatModelInfo, limits: IngressSettings) -> None:
        """A chat request's limits on the messages, or on the prompt's characters."""
        if self.messages is not None:
            check_messages(self.messages, limits)
        elif len(self.prompt) > limits.max_message_chars:
            raise APIError(error(f"prompt has {len(self.prompt)} characters; the limit is "
                                 f"{limits.max_message_chars}", param="prompt"))

    def prompt_messages(self, fmt: ToolFormat | None = None) -> tuple[dict, ...] | None:
        return None if self.messages is None else prompt_messages(self.messages, self.tools, fmt)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]

    def check(self, info: ChatModelInfo, limits: IngressSettings) -> None:
        if len(self.tokens) > limits.max_message_chars:
            raise APIError(error(f"at most {limits.max_message_chars} tokens", param="tokens"))
        if self.tokens and not 0 <= min(self.tokens) <= max(self.tokens) < info.vocab_size:
            raise APIError(error(f"token ids must be in [0, {info.vocab_size})", param="tokens"))
