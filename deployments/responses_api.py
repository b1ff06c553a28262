"""OpenAI's Responses API (`POST /v1/responses`), stateless, over the chat path.

A request is translated into a chat completion request (`ResponsesRequest.to_chat`): `instructions` become a
system message, `input` items become messages (a run of `function_call` items the assistant turn that made
them, a `function_call_output` a `tool` message), `tools` and `tool_choice` their chat forms, `text.format`
a `response_format`, `max_output_tokens` `max_tokens`. The generation then runs as a chat completion does
(admission, limits, grammars, a stream continued on another replica), and `ResponseBuilder` turns the chat
stream's chunks into the Responses object and its event sequence:

    response.created, response.in_progress,
    per output item: response.output_item.added,
      a message: response.content_part.added, response.output_text.delta..., response.output_text.done,
                 response.content_part.done;
      a function call: response.function_call_arguments.delta..., response.function_call_arguments.done;
    response.output_item.done; then response.completed (or response.incomplete when max_output_tokens cut it).

Nothing is stored: `store: true`, `previous_response_id`, `conversation` and `background` are 400s that say to
send the whole conversation as `input` instead; so is anything else the service does not do (hosted tools,
reasoning, images), naming it.
"""
from __future__ import annotations

import copy
import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .openai_api import ChatCompletionRequest, Completion, ToolPlan


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


def _responses_tool(tool: dict) -> dict:
    return {"type": "function", "name": tool["name"], "description": tool.get("description"),
            "parameters": tool.get("parameters") or {"type": "object", "properties": {}},
            "strict": tool.get("strict", True)}


class ResponseObject(BaseModel):
    """The response object, for the published OpenAPI schema (the builder writes it as a plain dict; OpenAI's
    document describes every field)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[dict]
    error: dict | None = None
    incomplete_details: dict | None = None
    instructions: str | None = None
    metadata: dict[str, str]
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool
    tool_choice: str | dict
    tools: list[dict]
    text: dict
    store: bool = False
    usage: dict | None = None


class ResponseBuilder:
    """Turns the chat stream's chunks (Completion's) into the Responses API's events and its response object.
    Used by generation.respond in Completion's place: first_chunks, feed, last_chunks, response, encode."""

    done = ""          # a Responses stream ends with its last event; no [DONE]

    def __init__(self, model: str, req: ResponsesRequest, plan: ToolPlan | None, params):
        self.chat = Completion(model, 1, tools=plan)
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.req, self.params, self.model = req, params, model
        self.seq = 0
        self.output: list[dict] = []          # items, as they stand
        self.open: dict | None = None         # the message or call being written
        self.calls: dict[int, dict] = {}      # a call's index in the chat stream -> its item
        self.finish: str | None = None

    # ---- the response object
    def _object(self, status: str) -> dict:
        req, p = self.req, self.params
        text_format = (req.text or {}).get("format") or {"type": "text"}
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "model": self.model, "output": copy.deepcopy(self.output), "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": req.instructions, "metadata": req.metadata or {},
               "temperature": p.temperature, "top_p": p.top_p, "max_output_tokens": req.max_output_tokens,
               "parallel_tool_calls": req.parallel_tool_calls is not False,
               "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
               "tools": [_responses_tool(t) for t in (req.tools or [])], "text": {"format": text_format},
               "previous_response_id": None, "reasoning": None, "store": False, "truncation": "auto"}
        if req.user is not None:
            out["user"] = req.user
        if status in ("completed", "incomplete"):
            u = self.chat.usage()
            cached = u["prompt_tokens_details"]["cached_tokens"]
            # the prompt tokens computed here stay in the KV-cache row, for the prefix cache to reuse
            out["usage"] = {"input_tokens": u["prompt_tokens"],
                            "input_tokens_details": {"cached_tokens": cached,
                                                     "cache_write_tokens": u["prompt_tokens"] - cached},
                            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": u["total_tokens"]}
        return out

    def response(self) -> dict:
        return self._object(self._status())

    def _status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    # ---- events
    def _event(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def first_chunks(self) -> list[dict]:
        return [self._event("response.created", response=self._object("in_progress")),
                self._event("response.in_progress", response=self._object("in_progress"))]

    def _add(self, item: dict) -> list[dict]:
        self.output.append(item)
        self.open = item
        return [self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))]

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.output.index(item)
        item["status"] = "incomplete" if self.finish == "length" else "completed"
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out += [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=dict(part))]
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
        return out + [self._event("response.output_item.done", output_index=index, item=dict(item))]

    def _text(self, text: str) -> list[dict]:
        out = []
        if self.open is None or self.open["type"] != "message":
            out += self._close()
            item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            out += self._add(item)
            item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=len(self.output) - 1,
                                   content_index=0, part=dict(item["content"][0])))
        part = self.open["content"][0]
        part["text"] += text
        out.append(self._event("response.output_text.delta", item_id=self.open["id"], output_index=len(self.output) - 1,
                               content_index=0, delta=text, logprobs=[]))
        return out

    def _call(self, delta: dict) -> list[dict]:
        out = []
        fn = delta.get("function") or {}
        if "id" in delta:             # a new call: its id and name come first
            out += self._close()
            item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": delta["id"],
                    "name": fn["name"], "arguments": "", "status": "in_progress"}
            self.calls[delta["index"]] = item
            out += self._add(item)
        item = self.calls[delta["index"]]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=self.output.index(item), delta=fn["arguments"]))
        return out

    def feed(self, ev) -> list[dict]:
        out = []
        for chunk in self.chat.feed(ev):
            choice = chunk["choices"][0]
            delta = choice["delta"]
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
            if choice["finish_reason"]:
                self.finish = choice["finish_reason"]
                out += self._close()
                status = self._status()
                out.append(self._event(f"response.{status}", response=self._object(status)))
        return out

    def last_chunks(self, include_usage: bool) -> list[dict]:
        return []

    def error_chunk(self, body: dict) -> dict:
        err = body["error"]
        return self._event("error", code=err.get("code") or err["type"], message=err["message"], param=err.get("param"))

    @staticmethod
    def encode(event: dict) -> str:
        return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"
