"""OpenAI chat-completions request models and response shaping (the HTTP boundary, pydantic)."""
from __future__ import annotations

import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class ContentPart(BaseModel):
    """A text part (OpenAI), or one of nanochat's calculator parts in an assistant turn."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "python", "python_output"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart] | None = None
    parts: list[ContentPart] | None = None     # our extension: an assistant reply with its calculator calls

    def for_prompter(self) -> dict:
        role = "system" if self.role == "developer" else self.role
        if self.parts is not None and role == "assistant":
            return {"role": role, "content": [p.model_dump() for p in self.parts]}
        if isinstance(self.content, list):
            return {"role": role, "content": [p.model_dump() for p in self.content]}
        return {"role": role, "content": self.content or ""}


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    messages: list[Message] = Field(min_length=1)
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False     # vLLM's extension: always generate max_tokens (fixed-length benchmarks)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return []
        v = [v] if isinstance(v, str) else v
        if len(v) > 4 or any(not s for s in v):
            raise ValueError("stop takes up to 4 non-empty strings")
        return v

    @model_validator(mode="after")
    def _one_max(self):
        if self.max_tokens and self.max_completion_tokens and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one")
        return self

    def params(self) -> dict:
        return {"max_tokens": self.max_completion_tokens or self.max_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "n": self.n, "seed": self.seed, "stop": self.stop,
                "ignore_eos": self.ignore_eos}


class Completion:
    """Accumulates engine events into OpenAI's chunk and completion objects."""

    def __init__(self, model: str, n: int):
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.text = [""] * n
        self.parts: list[list[dict]] = [[] for _ in range(n)]
        self.segment_text = [""] * n
        self.segment_kind: list[str | None] = [None] * n
        self.finish = [None] * n
        self.prompt_tokens = 0
        self.completion_tokens = [0] * n

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def usage(self) -> dict:
        c = sum(self.completion_tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": c, "total_tokens": self.prompt_tokens + c}

    def _add_part(self, i: int, kind: str, text: str) -> None:
        parts = self.parts[i]
        if parts and parts[-1]["type"] == kind == "text":
            parts[-1]["text"] += text
        elif text or kind != "text":
            parts.append({"type": kind, "text": text})

    def feed(self, ev: dict) -> list[dict]:
        """One engine event -> the stream chunks it produces (possibly none). Text streams as `content`; a
        calculator call or its output is sent whole, as one `parts` delta, when it closes."""
        i = ev["index"]
        self.prompt_tokens = ev["prompt_tokens"]
        self.completion_tokens[i] = max(self.completion_tokens[i], ev["completion_tokens"])
        chunks = []
        if ev["segment"] == "text":
            if ev["text"]:
                self.text[i] += ev["text"]
                self._add_part(i, "text", ev["text"])
                chunks.append(self._chunk([{"index": i, "delta": {"content": ev["text"]}, "finish_reason": None}]))
        else:
            self.segment_text[i] += ev["text"]
            self.segment_kind[i] = ev["segment"]
            if ev["closes"]:
                chunks += self._end_segment(i)
        if ev["finish_reason"]:
            if self.segment_kind[i]:       # cut off inside a calculator call
                chunks += self._end_segment(i)
            self.finish[i] = "length" if ev["finish_reason"] == "length" else "stop"
            chunks.append(self._chunk([{"index": i, "delta": {}, "finish_reason": self.finish[i]}]))
        return chunks

    def _end_segment(self, i: int) -> list[dict]:
        kind, text = self.segment_kind[i], self.segment_text[i]
        self.segment_kind[i], self.segment_text[i] = None, ""
        self._add_part(i, kind, text)
        return [self._chunk([{"index": i, "delta": {"parts": [{"type": kind, "text": text}]},
                              "finish_reason": None}])]

    def first_chunks(self) -> list[dict]:
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
                for i in range(len(self.text))]

    def usage_chunk(self) -> dict:
        return self._chunk([], self.usage())

    def response(self) -> dict:
        choices = []
        for i, text in enumerate(self.text):
            msg = {"role": "assistant", "content": text}
            if any(p["type"] != "text" for p in self.parts[i]):
                msg["parts"] = self.parts[i]
            choices.append({"index": i, "message": msg, "finish_reason": self.finish[i] or "stop"})
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
