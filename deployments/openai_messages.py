"""The conversation of an OpenAI request: messages, their content parts and tool calls, and the tools a request
offers; how they reach the prompter, and the Ingress's limits on them."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.chat.grammars import tools_text
from core.chat.protocol import ToolFormat

from .errors import APIError, error
from .settings import IngressSettings


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



def prompt_messages(messages: list[Message], tools: list[Tool] | None, fmt: ToolFormat | None) -> tuple[dict, ...]:
    """A conversation for the prompter; with tools, a system message that describes them (and how to call them in
    the format `fmt`) comes first."""
    out = tuple(m.for_prompter() for m in messages)
    if tools:
        out = ({"role": "system", "content": tools_text([t.model_dump() for t in tools], fmt)},) + out
    return out


def check_messages(messages: list[Message], limits: IngressSettings) -> None:
    """The Ingress's limits on a conversation: messages per request, characters per message (a 400 naming it)."""
    if len(messages) > limits.max_messages:
        raise APIError(error(f"at most {limits.max_messages} messages per request, got {len(messages)}",
                             param="messages"))
    for i, m in enumerate(messages):
        parts = m.parts or (m.content if isinstance(m.content, list) else [])
        size = len(m.content) if isinstance(m.content, str) else sum(len(p.text) for p in parts)
        if size > limits.max_message_chars:
            raise APIError(error(f"messages[{i}] has {size} characters; the limit is {limits.max_message_chars}",
                                 param=f"messages[{i}].content"))
