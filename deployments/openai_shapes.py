"""Every JSON shape the service answers with, written once: the handlers build their answers by calling these
TypedDicts (a plain dict each, no validation on the hot path) and the published schema (openapi.py) is
generated from the same classes. Each forbids keys it does not list, so a test that validates a handler's
answer against its shape (tests/test_openai_shapes.py) fails on any key the schema does not publish.
"""
from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, with_config
from typing_extensions import NotRequired, TypedDict

shape = with_config(ConfigDict(extra="forbid"))


# ---- pieces of a chat or text completion
@shape
class TokenLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int] | None


@shape
class LogprobEntry(TypedDict):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TokenLogprob]


@shape
class ChoiceLogprobs(TypedDict):
    content: list[LogprobEntry] | None
    refusal: None                       # always null: the models here do not refuse


@shape
class OutputPart(TypedDict):
    """A part of a reply in order: text, a calculator call (python) or its result (python_output)."""
    type: Literal["text", "python", "python_output"]
    text: str


@shape
class CalledFunction(TypedDict):
    name: str
    arguments: str                      # JSON text, as OpenAI sends it


@shape
class AssistantToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: CalledFunction


@shape
class PromptTokensDetails(TypedDict):
    cached_tokens: int


@shape
class CompletionUsage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


# ---- chat completions
@shape
class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: str | None                 # null when the reply is tool calls
    refusal: None                       # OpenAI's field: these models never refuse
    tool_calls: NotRequired[list[AssistantToolCall]]   # with tools that were (or could have been) called
    parts: NotRequired[list[OutputPart]]     # our extension: the reply with its calculator calls and results


@shape
class ChatChoice(TypedDict):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None     # null unless the request asked for logprobs


@shape
class ChatCompletionResponse(TypedDict):
    """Without `stream`; with it, `text/event-stream` of ChatCompletionChunk objects, then `data: [DONE]`."""
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage


@shape
class FunctionDelta(TypedDict):
    name: NotRequired[str]              # in a call's first delta
    arguments: str


@shape
class ToolCallDelta(TypedDict):
    index: int                          # the call's place in the reply
    id: NotRequired[str]                # id, type and name come in a call's first delta
    type: NotRequired[Literal["function"]]
    function: FunctionDelta


@shape
class ChunkDelta(TypedDict):
    role: NotRequired[Literal["assistant"]]   # in each choice's first chunk
    content: NotRequired[str | None]
    parts: NotRequired[list[OutputPart]]      # a calculator call or its result, whole, when it closes
    tool_calls: NotRequired[list[ToolCallDelta]]


@shape
class ChunkChoice(TypedDict):
    index: int
    delta: ChunkDelta
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    logprobs: ChoiceLogprobs | None     # the entries of the tokens this chunk's text brings


@shape
class ChatCompletionChunk(TypedDict):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]          # empty in the usage chunk
    usage: NotRequired[CompletionUsage]      # the last chunk, with stream_options.include_usage


# ---- text completions
@shape
class LegacyLogprobs(TypedDict):
    tokens: list[str]
    token_logprobs: list[float | None]  # with echo, the prompt's first token has none
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


@shape
class TextChoice(TypedDict):
    index: int
    text: str
    logprobs: LegacyLogprobs | None
    finish_reason: Literal["stop", "length"] | None     # null in a stream's chunks before the last
    parts: NotRequired[list[OutputPart]]


@shape
class TextCompletionResponse(TypedDict):
    """Without `stream`; with it, `text/event-stream` of TextCompletionChunk objects, then `data: [DONE]`."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: CompletionUsage


@shape
class TextCompletionChunk(TypedDict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: NotRequired[CompletionUsage]


# ---- tokens, models, health, errors
@shape
class TokenizeResponse(TypedDict):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None        # each token's text (a special token's name), with return_token_strs


@shape
class DetokenizeResponse(TypedDict):
    prompt: str


@shape
class ModelCard(TypedDict):
    id: str
    object: Literal["model"]
    created: int                        # the checkpoint's time (its config file's modification time)
    owned_by: str
    kind: Literal["chat", "decision"]
    alias_of: NotRequired[str]          # another name of the model `alias_of`


@shape
class ModelList(TypedDict):
    object: Literal["list"]
    data: list[ModelCard]


@shape
class Health(TypedDict):
    status: Literal["ok", "unavailable"]
    models: NotRequired[dict[str, Literal["ok", "unavailable"]]]   # each model by name


@shape
class ErrorDetail(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | None
    errors: NotRequired[dict[str, str]]     # /v1/systemone: every bad question by name


@shape
class ErrorResponse(TypedDict):
    error: ErrorDetail


# ---- the Responses API (OpenAI's document describes the output items and events in full)
@shape
class ResponseInputTokensDetails(TypedDict):
    cached_tokens: int
    cache_write_tokens: int             # the prompt tokens computed here, left in the KV cache for reuse


@shape
class ResponseOutputTokensDetails(TypedDict):
    reasoning_tokens: int


@shape
class ResponseUsage(TypedDict):
    input_tokens: int
    input_tokens_details: ResponseInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponseOutputTokensDetails
    total_tokens: int


@shape
class ResponseObject(TypedDict):
    """POST /v1/responses without `stream`; with it, `text/event-stream` of Responses events, the last one
    response.completed or response.incomplete."""
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[dict]                  # message and function_call items
    error: None
    incomplete_details: dict | None     # {"reason": "max_output_tokens"} when that cut it
    instructions: str | None
    metadata: dict[str, str]
    temperature: float
    top_p: float
    max_output_tokens: int | None
    parallel_tool_calls: bool
    tool_choice: str | dict
    tools: list[dict]
    text: dict
    previous_response_id: None          # nothing is stored
    reasoning: None
    store: Literal[False]
    truncation: Literal["auto"]
    user: NotRequired[str]
    usage: NotRequired[ResponseUsage]   # once the response is complete or incomplete
