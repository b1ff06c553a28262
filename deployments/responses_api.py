"""OpenAI's Responses API (`POST /v1/responses`), stateless, over the chat path.

A request is translated into a chat completion request (`ResponsesRequest.to_chat`): `instructions` become a
system message, `input` items become messages (a run of `function_call` items the assistant turn that made
them, a `function_call_output` a `tool` message), `tools` and `tool_choice` their chat forms, `text.format`
a `response_format`, `max_output_tokens` `max_tokens`. The generation then runs as a chat completion does
(admission, limits, grammars, a stream continued on another replica), and `ResponseBuilder`
(responses_stream.py) turns the chat stream into the Responses object and its event sequence.

Nothing is stored: `store: true`, `previous_response_id`, `conversation` and `background` are 400s that say to
send the whole conversation as `input` instead; so is anything else the service does not do (hosted tools,
reasoning, images), naming it.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .openai_requests import ChatCompletionRequest


class InputError(ValueError):
    """Part of a Responses request that has no chat form: a 400 with `param` naming it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param

# Fields of OpenAI's CreateResponse that this service refuses, with what they ask for: a request that sends one
# (not null, not its "off" value) gets a 400 naming it.
REFUSED = {
    "previous_response_id": "continuing a stored response (nothing is stored: send the whole conversation as "
                            "`input`)",
    "conversation": "stored conversations (send the whole conversation as `input`)",
    "background": "background responses",
    "prompt": "stored prompt templates",
    "reasoning": "reasoning options (these models do not reason)",
    "top_logprobs": "log-probabilities in responses (use /v1/chat/completions with logprobs)",
    "max_tool_calls": "a limit on built-in tool calls (there are no built-in tools)",
    "include": "extra output data",
    "prompt_cache_retention": "prompt cache retention (the prefix cache keeps what memory allows)",
}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: dict | None = None
    store: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    # refused when set (REFUSED)
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    background: bool | None = None
    prompt: dict | None = None
    reasoning: dict | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    include: list[str] | None = None
    prompt_cache_retention: str | None = None

    @model_validator(mode="after")
    def _refused(self):
        if self.store:
            raise ValueError("store: true is not supported: this service keeps no responses (send store false, or "
                             "leave it out, and send the whole conversation as `input`)")
        for name, what in REFUSED.items():
            value = getattr(self, name)
            if value not in (None, False, [], {}) and not (name == "reasoning" and not any(value.values())):
                raise ValueError(f"`{name}` is not supported by this service ({what}); send the request without it")
        if self.stream_options and set(self.stream_options) - {"include_obfuscation"}:
            raise ValueError("stream_options takes only include_obfuscation")
        return self

    def to_chat(self) -> ChatCompletionRequest:
        """The chat completion request that generates this response; InputError for what has no chat form."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for i, item in enumerate(items):
            _add_item(messages, item, f"input[{i}]")
        body = {"messages": messages, "stream": self.stream, "temperature": self.temperature, "top_p": self.top_p,
                "max_tokens": self.max_output_tokens, "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools:
            body["tools"] = [_chat_tool(t, f"tools[{i}]") for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        fmt = (self.text or {}).get("format")
        if set(self.text or {}) - {"format", "verbosity"} or (self.text or {}).get("verbosity") not in (None, "medium"):
            raise InputError("text takes `format` only (verbosity is not supported)", "text")
        if fmt is not None:
            body["response_format"] = _chat_format(fmt)
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            param = {"max_tokens": "max_output_tokens"}.get(where, where if where in body else "input")
            raise InputError(f"{first['msg'].removeprefix('Value error, ')} (as a chat request, at {where})",
                             param) from None


def _text_of(content, where: str, kinds: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InputError(f"{where}.content must be text or a list of {' / '.join(kinds)} parts", where)
    out = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise InputError(f"{where}.content[{k}]: a part of type {kind!r} is not supported here (send "
                             f"{' or '.join(kinds)} parts with `text`)", f"{where}.content[{k}]")
        out.append(part["text"])
    return "".join(out)


def _add_item(messages: list[dict], item, where: str) -> None:
    """One Responses input item into the chat messages (in place)."""
    if not isinstance(item, dict):
        raise InputError(f"{where} must be an object", where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise InputError(f"{where}.role must be user, system, developer or assistant, got {role!r}",
                             f"{where}.role")
        kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
        messages.append({"role": role, "content": _text_of(item.get("content"), where, kinds + ("text",))})
    elif kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
        if not isinstance(call["id"], str) or not isinstance(call["function"]["name"], str):
            raise InputError(f"{where}: a function_call needs call_id and name", where)
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise InputError(f"{where}: a function_call_output needs the call_id of its call", where)
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": output if isinstance(output, str) else _text_of(output, where, ("input_text",))})
    else:
        raise InputError(f"{where}: input items of type {kind!r} are not supported (send messages, function_call "
                         "and function_call_output items)", f"{where}.type")


def _chat_tool(tool, where: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise InputError(f"{where}: tools of type {kind!r} are not supported (only function tools: this service "
                         "runs no built-in tools)", f"{where}.type")
    extra = set(tool) - {"type", "name", "description", "parameters", "strict"}
    if extra:
        raise InputError(f"{where}: {', '.join(sorted(extra))} not supported on a function tool", where)
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice):
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InputError("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\": ...}",
                     "tool_choice")


def _chat_format(fmt) -> dict:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise InputError(f"text.format type {kind!r} is not one of text, json_object, json_schema", "text.format")
