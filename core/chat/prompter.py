"""OpenAI-style messages -> prompt ids in the chat format the model was trained on.

    <|bos|> [few-shot turns from chat.json] [conversation turns] <|assistant_start|>

A user turn is `<|user_start|> text <|user_end|>`. An assistant turn is `<|assistant_start|> ...
<|assistant_end|>`, where its content is a string or nanochat's list of parts: `{"type": "text"}`,
`{"type": "python"}` (a calculator call, wrapped in <|python_start|>..<|python_end|>) and
`{"type": "python_output"}` (its result, in <|output_start|>..<|output_end|>), so a client can send
a tool-using reply back in the history.

Function tools (OpenAI's `tools`): an assistant turn that carries `tool_calls` shows its text, then each call in
the checkpoint's tool-call format (`ToolFormat`, e.g. `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`),
or, for a model without one, the calls as `[{"name": ..., "arguments": {...}}]` (the layout
`tool_choice: "required"` generates then, grammars.py); a `tool` message (a call's result) is a user turn,
`Result of <function>: <content>`, the function named by the call its `tool_call_id` answers. A conversation
may end with tool results instead of a user turn, as an agent's loop sends it.

System messages: the model has no system role (nanochat's format), so the text of all system
messages is joined and prepended to the first user turn that is kept. It survives truncation.

Truncation: the oldest whole turns are dropped until the prompt fits `sequence_len - max_new_tokens`
(a kept history never starts with an assistant turn). When the newest user turn (with the system
text) alone does not fit, `PromptTooLong` is raised rather than a prompt sent without the question in it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from .protocol import ToolFormat
from .tokenizer import ChatTokenizer

ROLES = ("system", "user", "assistant", "tool")
PART_TOKENS = {"text": None, "python": ("<|python_start|>", "<|python_end|>"),
               "python_output": ("<|output_start|>", "<|output_end|>")}


class PromptError(ValueError):
    """The messages cannot be rendered; the message says which one and why."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLong(PromptError):
    """Even the newest user turn does not fit the context window."""


@dataclass
class Prompt:
    ids: list[int]
    dropped_turns: int      # conversation turns left out to fit


class ChatPrompter:
    def __init__(self, tokenizer: ChatTokenizer, sequence_len: int, fewshot: list[dict] | None = None,
                 tool_format: ToolFormat | None = None):
        self.tok = tokenizer
        self.sequence_len = sequence_len
        self.tool_format = tool_format
        t = tokenizer.encode_special
        self.bos, self.user_start, self.user_end = t("<|bos|>"), t("<|user_start|>"), t("<|user_end|>")
        self.assistant_start, self.assistant_end = t("<|assistant_start|>"), t("<|assistant_end|>")
        self.prefix_ids = [self.bos]
        for i, turn in enumerate(fewshot or []):
            self.prefix_ids += self._turn(turn, f"fewshot[{i}]")

    def _content_parts(self, msg: dict, where: str) -> list[tuple[str, str]]:
        content = msg.get("content")
        if isinstance(content, str):
            return [("text", content)]
        if not isinstance(content, list):
            raise PromptError(f"{where}.content must be a string or a list of parts", where)
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in PART_TOKENS or not isinstance(part.get("text"), str):
                raise PromptError(f"{where}.content[{j}] must be {{'type': text|python|python_output, 'text': str}}",
                                  where)
            if kind != "text" and msg.get("role") != "assistant":
                raise PromptError(f"{where}.content[{j}]: only assistant turns may carry calculator parts", where)
            parts.append((kind, part["text"]))
        return parts

    def _turn(self, msg: dict, where: str, system_text: str = "", called: dict | None = None) -> list[int]:
        parts = self._content_parts(msg, where)
        if msg["role"] in ("user", "tool"):
            text = "".join(t for _, t in parts)
            if msg["role"] == "tool":
                name = (called or {}).get(msg.get("tool_call_id")) or msg.get("name") or "the function"
                text = f"Result of {name}: {text}"
            if system_text:
                text = system_text + "\n\n" + text
            return [self.user_start, *self.tok.encode(text), self.user_end]
        ids = [self.assistant_start]
        for kind, text in parts:
            wrap = PART_TOKENS[kind]
            if wrap is None:
                ids += self.tok.encode(text)
            else:
                ids += [self.tok.encode_special(wrap[0]), *self.tok.encode(text), self.tok.encode_special(wrap[1])]
        if msg.get("tool_calls"):
            ids += self.tok.encode(calls_text(msg["tool_calls"], self.tool_format))
        return ids + [self.assistant_end]

    def render(self, messages: list[dict], max_new_tokens: int) -> Prompt:
        if not isinstance(messages, list) or not messages:
            raise PromptError("messages must be a non-empty list", "messages")
        system, convo = [], []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                role = m.get("role") if isinstance(m, dict) else None
                raise PromptError(f"{where}.role must be one of {ROLES}, got {role!r}", where)
            if m["role"] == "system":
                system.append("".join(t for _, t in self._content_parts(m, where)))
            else:
                convo.append((where, m))
        if not convo or convo[-1][1]["role"] not in ("user", "tool"):
            raise PromptError("the last non-system message must come from the user (or be a tool result)",
                              "messages")
        system_text = "\n\n".join(s for s in system if s)
        budget = self.sequence_len - max_new_tokens - len(self.prefix_ids) - 1   # 1: <|assistant_start|>
        called = {c.get("id"): c["function"]["name"] for _, m in convo for c in m.get("tool_calls") or ()}
        plain = [self._turn(m, where, called=called) for where, m in convo]
        # Walk back from the newest turn; a history may start at any user turn k, whose rendering then
        # also carries the system text. Keep the longest history that fits.
        best, tail = None, 0
        for k in range(len(convo) - 1, -1, -1):
            tail += len(plain[k])
            if convo[k][1]["role"] != "user":
                continue
            first = self._turn(convo[k][1], convo[k][0], system_text) if system_text else plain[k]
            if tail - len(plain[k]) + len(first) > budget:
                break
            best = (k, first)
        if best is None:
            need = len(self.prefix_ids) + 1 + len(self._turn(convo[-1][1], convo[-1][0], system_text, called))
            raise PromptTooLong(
                f"the newest user message needs {need} prompt tokens but only {self.sequence_len - max_new_tokens} "
                f"fit in the context window of {self.sequence_len} tokens with max_tokens={max_new_tokens}; "
                f"shorten the message or lower max_tokens", "messages")
        k, first = best
        ids = [*self.prefix_ids, *first]
        for turn in plain[k + 1:]:
            ids += turn
        ids.append(self.assistant_start)
        return Prompt(ids, k)


def calls_text(calls: list[dict], fmt: ToolFormat | None = None) -> str:
    """An assistant's tool calls as its turn shows them: each in the tool-call format `fmt`, or without one
    `[{"name": ..., "arguments": {...}}]`; the layout of grammars.JSON_LAYOUT (arguments that are not valid JSON
    are kept as a string)."""
    items = []
    for c in calls:
        args = c["function"].get("arguments") or "{}"
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = args
        items.append({"name": c["function"]["name"], "arguments": parsed})
    if fmt is not None:
        return "".join(fmt.call_text(c["name"], c["arguments"]) for c in items)
    return json.dumps(items, ensure_ascii=False)
