"""The Responses API's answers (`POST /v1/responses`): `ResponseBuilder` turns the chat stream, through a
`Completion` (completion.py), into OpenAI's event sequence and its response object:

    response.created, response.in_progress,
    per output item: response.output_item.added,
      a message: response.content_part.added, response.output_text.delta..., response.output_text.done,
                 response.content_part.done;
      a function call: response.function_call_arguments.delta..., response.function_call_arguments.done;
    response.output_item.done; then response.completed (or response.incomplete when max_output_tokens cut it).
"""
from __future__ import annotations

import copy
import time
import uuid

import msgspec

from core.chat.grammars import ToolPlan
from core.chat.protocol import SamplingParams

from .completion import Completion
from .openai_shapes import (ResponseInputTokensDetails, ResponseObject, ResponseOutputTokensDetails,
                            ResponseUsage)
from .responses_api import ResponsesRequest


_JSON = msgspec.json.Encoder()


def _responses_tool(tool: dict) -> dict:
    return {"type": "function", "name": tool["name"], "description": tool.get("description"),
            "parameters": tool.get("parameters") or {"type": "object", "properties": {}},
            "strict": tool.get("strict", True)}


class ResponseBuilder:
    """Turns the chat stream's chunks (Completion's) into the Responses API's events and its response object.
    Used by generation.respond in Completion's place: first_chunks, feed, last_chunks, response, encode."""

    done = ""          # a Responses stream ends with its last event; no [DONE]

    def __init__(self, model: str, req: ResponsesRequest, plan: ToolPlan | None, params: SamplingParams):
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
    @property
    def finished(self) -> bool:
        return self.chat.finished

    def _object(self, status: str) -> ResponseObject:
        req, p = self.req, self.params
        text_format = (req.text or {}).get("format") or {"type": "text"}
        out = ResponseObject(
            id=self.id, object="response", created_at=self.created, status=status, model=self.model,
            output=copy.deepcopy(self.output), error=None,
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
            instructions=req.instructions, metadata=req.metadata or {}, temperature=p.temperature, top_p=p.top_p,
            max_output_tokens=req.max_output_tokens, parallel_tool_calls=req.parallel_tool_calls is not False,
            tool_choice=req.tool_choice or ("auto" if req.tools else "none"),
            tools=[_responses_tool(t) for t in (req.tools or [])], text={"format": text_format},
            previous_response_id=None, reasoning=None, store=False, truncation="auto")
        if req.user is not None:
            out["user"] = req.user
        if status in ("completed", "incomplete"):
            u = self.chat.usage()
            cached = u["prompt_tokens_details"]["cached_tokens"]
            out["usage"] = ResponseUsage(
                input_tokens=u["prompt_tokens"],
                input_tokens_details=ResponseInputTokensDetails(cached_tokens=cached,
                                                                cache_write_tokens=u["prompt_tokens"] - cached),
                output_tokens=u["completion_tokens"],
                output_tokens_details=ResponseOutputTokensDetails(reasoning_tokens=0),
                total_tokens=u["total_tokens"])
        return out

    def response(self) -> ResponseObject:
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
        return f"event: {event['type']}\ndata: {_JSON.encode(event).decode()}\n\n"
