"""Structured outputs, the torch-free half: what a request's `response_format` or `tools` ask for, as a grammar
for constrained decoding (llguidance), and the tool calls read back out of the constrained text.

The engine enforces a grammar token by token (constrained.py); this module decides which grammar:

- `response_format: {"type": "json_object"}` -> any JSON object;
- `response_format: {"type": "json_schema", "json_schema": {"schema": ...}}` -> JSON valid against the schema;
- `tools` with `tool_choice` naming a function -> that function's arguments, a JSON object valid against its
  `parameters` (the whole constrained text is the arguments);
- vLLM's `structured_outputs` -> `json` (a schema, as above), `json_object`, `regex` (the regex crate's syntax,
  matched whole), `choice` (exactly one of the strings) or `grammar` (Lark, llguidance's dialect);
- `tools` with `tool_choice: "required"` -> a JSON array of calls, `[{"name": ..., "arguments": {...}}, ...]`,
  each item one of the functions (at most one item with `parallel_tool_calls: false`).

A checkpoint that declares a tool-call format (chat.json `tool_call`, a `ToolFormat`: text that opens a call and
text that closes it, as Hermes-style models write `<tool_call>{...}</tool_call>`) gets its calls in that format
instead, and `tool_choice: "auto"` too: free text that never contains the opening text, or free text up to the
first opening text and from there calls only, each `{"name": ..., "arguments": {...}}` of one of the functions
(one call with `parallel_tool_calls: false`). "required" is calls only, a named function one call of it. The
grammar is a Lark one (llguidance's dialect): the text before a call is a lazy lexeme ending at the opening text,
so the model writes freely until it starts a call and is held to the schemas from there on.

JSON is written in one layout, Python's `json.dumps` one (`{"a": 1, "b": [2, 3]}`: ", " between items, ": "
after keys, no other whitespace), and object keys in the schema's order. A fixed layout keeps a model from
spending its tokens on whitespace (a known way for JSON mode to run to the length limit) and lets a stream of
tool calls be read as it comes. A schema keyword the grammar cannot enforce (llguidance's list: `uniqueItems`,
`not`, `if`/`then`, an unknown `format`, ...) is an error that names it: nothing is dropped silently.

Importing this module imports llguidance (no torch): the Ingress checks every grammar before a replica sees it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance

from .protocol import SamplingError, ToolFormat

# llguidance's JSON compile options: the fixed layout described above
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(SamplingError):
    """A schema or tool definition that cannot be enforced; `param` names the request field."""


def json_grammar(schema: dict, param: str) -> str:
    """The llguidance grammar of JSON valid against `schema`; GrammarError (naming `param`) if it cannot be
    enforced."""
    if not isinstance(schema, dict):
        raise GrammarError(f"{param} must be a JSON schema object", param)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"{param}: {e}", param) from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(f"{param} cannot be enforced: {_short(messages[0])}", param)
    if messages:      # warnings are keywords it would ignore: refused as well, never dropped
        raise GrammarError(f"{param} cannot be enforced: {'; '.join(_short(m) for m in messages)}", param)
    return grammar


def _short(message: str) -> str:
    message = message.split("\n", 1)[0].removeprefix("WARNING: ").strip()
    if "oneOf constraints are not supported" in message:
        return ("oneOf (a grammar cannot check that exactly one branch matches; send anyOf when the branches "
                "exclude each other)")
    return message


# ---- response_format
def response_format_grammar(fmt: dict | None) -> str | None:
    """The grammar a `response_format` asks for (None for text or absent); GrammarError for one this service
    cannot enforce."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise GrammarError("response_format must be an object with a `type`", "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise GrammarError("response_format.json_schema must be {\"name\": ..., \"schema\": {...}}",
                               "response_format.json_schema")
        return json_grammar(spec.get("schema") or {"type": "object"}, "response_format.json_schema.schema")
    raise GrammarError(f"response_format type {kind!r} is not one of text, json_object, json_schema",
                       "response_format")


# vLLM's StructuredOutputsParams: the kinds (one per request), and the options this service takes as they are
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
STRUCTURED_REFUSED = {
    "whitespace_pattern": "a whitespace pattern (JSON is written in one layout here)",
    "structural_tag": "structural tags",
}


def structured_outputs_grammar(spec) -> str | None:
    """The grammar of vLLM's `structured_outputs` body field (None when absent or empty of a kind); GrammarError
    for more than one kind, an option that is not served, or a pattern or grammar that llguidance refuses.
    `disable_any_whitespace` and `disable_fallback` are taken (JSON here never has free whitespace, and there
    is no fallback); `disable_additional_properties` only as false."""
    param = "structured_outputs"
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise GrammarError(f"{param} must be an object with one of {', '.join(STRUCTURED_KINDS)}", param)
    known = set(STRUCTURED_KINDS) | set(STRUCTURED_REFUSED) | {
        "disable_any_whitespace", "disable_fallback", "disable_additional_properties"}
    for key, value in spec.items():
        if key not in known:
            raise GrammarError(f"{param}.{key} is not a structured-output option (send one of "
                               f"{', '.join(STRUCTURED_KINDS)})", f"{param}.{key}")
        if key in STRUCTURED_REFUSED and value is not None:
            raise GrammarError(f"{param}.{key}: {STRUCTURED_REFUSED[key]} is not supported", f"{param}.{key}")
    if spec.get("disable_additional_properties"):
        raise GrammarError(f"{param}.disable_additional_properties is not supported: say "
                           "\"additionalProperties\": false in the schema", f"{param}.disable_additional_properties")
    kinds = [k for k in STRUCTURED_KINDS if spec.get(k) not in (None, False)]
    if len(kinds) > 1:
        raise GrammarError(f"{param} takes one of {', '.join(STRUCTURED_KINDS)}; got {', '.join(kinds)}", param)
    if not kinds:
        return None
    kind = kinds[0]
    value, where = spec[kind], f"{param}.{kind}"
    if kind == "json_object":
        if value is not True:
            raise GrammarError(f"{where} must be true", where)
        return json_grammar({"type": "object"}, where)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise GrammarError(f"{where} must be a JSON schema (an object, or its JSON text)", where) from None
        return json_grammar(value, where)
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise GrammarError(f"{where} must be a non-empty regular expression", where)
        return _checked(llguidance.LLMatcher.grammar_from_regex(value), where)
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, (str, int, float)) and not isinstance(c, bool) for c in value)):
            raise GrammarError(f"{where} must be a non-empty list of strings", where)
        options = [str(c) for c in value]
        if not all(options):
            raise GrammarError(f"{where}: a choice must not be empty", where)
        return _checked(llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(f"/{_regex_literal(c)}/" for c in options)), where)
    if not isinstance(value, str) or not value.strip():
        raise GrammarError(f"{where} must be a grammar in Lark syntax", where)
    if "::=" in value:
        raise GrammarError(f"{where} looks like GBNF/EBNF (`::=`); this service takes grammars in Lark syntax "
                           "(`rule: ...`, llguidance's dialect)", where)
    return _checked(llguidance.LLMatcher.grammar_from_lark(value), where)


def _checked(grammar: str, param: str) -> str:
    """`grammar` if llguidance takes it without errors or warnings; else GrammarError with its first message."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error or messages:
        why = [line.strip() for line in messages[0].splitlines() if line.strip().startswith("error:")]
        raise GrammarError(f"{param} cannot be enforced: {_short(messages[0])}{' ' + why[0] if why else ''}", param)
    return grammar


# ---- tools
@dataclass(frozen=True)
class ToolPlan:
    """How a request's tools are used: `mode` "named" (one call of `names[0]`), "required" (one or more calls),
    "auto" (text, calls, or text then calls: only with a `format`) or "none" (text; the tools are only
    described). Without a format a named call's text is its arguments and required calls are a JSON array."""

    mode: str
    names: tuple[str, ...]
    grammar: str | None
    format: ToolFormat | None = None


AUTO_REFUSED = ("tool_choice \"auto\" (the default when tools are sent) lets the model decide whether to call a "
                "tool, and this model has no tool-call format to decide with; send tool_choice \"required\" (the "
                "reply is one or more calls), {\"type\": \"function\", \"function\": {\"name\": ...}} (a call of "
                "that function), or \"none\" (a text reply)")


def tool_plan(tools: list[dict], tool_choice, parallel: bool | None, fmt: ToolFormat | None = None) -> ToolPlan:
    """The plan for `tools` (OpenAI function tools, already shape-checked) under `tool_choice`, for a model with
    the tool-call format `fmt` (or none); GrammarError for a choice that cannot be served or a `parameters`
    schema that cannot be enforced."""
    names = tuple(t["function"]["name"] for t in tools)
    if len(set(names)) != len(names):
        raise GrammarError("tools must have distinct function names", "tools")
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if tool_choice == "none":
        return ToolPlan("none", names, None, fmt)
    if fmt is not None:
        return _format_plan(tools, params, tool_choice, parallel, fmt)
    if tool_choice is None or tool_choice == "auto":
        raise GrammarError(AUTO_REFUSED, "tool_choice")
    if tool_choice == "required":
        schema = {"type": "array", "minItems": 1, "items": _call_schema(names, params)}
        if parallel is False:
            schema["maxItems"] = 1
        try:
            return ToolPlan("required", names, json_grammar(schema, "tools"))
        except GrammarError:
            _name_the_tool(tools, params)
            raise
    name = _named(tool_choice, names)
    i = names.index(name)
    return ToolPlan("named", (name,), json_grammar(params[name], f"tools[{i}].function.parameters"))


def _call_schema(names: tuple[str, ...], params: dict) -> dict:
    """The JSON schema of one call, `{"name": ..., "arguments": {...}}`, of any of the functions `names`."""
    calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": params[n]},
              "required": ["name", "arguments"], "additionalProperties": False} for n in names]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _named(tool_choice, names: tuple[str, ...]) -> str:
    """The function a `tool_choice` object names; GrammarError for anything else."""
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise GrammarError(f"tool_choice names {name!r}, which is not among the tools {list(names)}",
                               "tool_choice")
        return name
    raise GrammarError("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}}", "tool_choice")


# Rust regex's metacharacters (llguidance's regexes are the regex crate's): escaped in a literal
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def _regex_literal(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text).replace("\n", "\\n").replace("/", "\\/")


def _format_plan(tools: list[dict], params: dict, tool_choice, parallel: bool | None, fmt: ToolFormat) -> ToolPlan:
    """The Lark grammar of calls in the checkpoint's format (module docstring)."""
    names = tuple(params)
    if tool_choice is None or tool_choice == "auto":
        mode, allowed = "auto", names
    elif tool_choice == "required":
        mode, allowed = "required", names
    else:
        mode = "named"
        allowed = (_named(tool_choice, names),)
    for i, t in enumerate(tools):      # each function's parameters alone first, so that an error names its tool
        if t["function"]["name"] in allowed:
            json_grammar(params[t["function"]["name"]], f"tools[{i}].function.parameters")
    body = {"x-guidance": JSON_LAYOUT, **_call_schema(allowed, params)}
    more = "" if parallel is False or mode == "named" else " (START body END)*"
    start, end = json.dumps(fmt.start), json.dumps(fmt.end)
    lines = ["%llguidance {}"]
    if mode == "auto":
        text = _regex_literal(fmt.start)
        lines += [f"start: PLAIN | before body END{more}",
                  f"PLAIN: /(.|\\n)*/ & ~/(.|\\n)*{text}(.|\\n)*/",
                  f"before[lazy]: /(.|\\n)*{text}/"]
    else:
        lines += [f"start: START body END{more}"]
    lines += [f"body: %json {json.dumps(body)}", f"START: {start}", f"END: {end}"]
    return ToolPlan(mode, allowed, _checked(llguidance.grammar_from("lark", "\n".join(lines)), "tools"), fmt)


def _name_the_tool(tools: list[dict], params: dict) -> None:
    """After the array of calls failed to compile: each function's parameters on their own, so that the error
    names the tool it is in."""
    for i, t in enumerate(tools):
        json_grammar(params[t["function"]["name"]], f"tools[{i}].function.parameters")


def tools_text(tools: list[dict], fmt: ToolFormat | None = None) -> str:
    """The tools as the prompt describes them (a system text): one line per function with its description, then
    its parameters' schema as JSON; with a tool-call format, a last line that shows a call in it."""
    lines = ["Functions you can call:"]
    for t in tools:
        f = t["function"]
        line = f"- {f['name']}"
        if f.get("description"):
            line += f": {f['description']}"
        lines.append(line)
        lines.append(f"  parameters: {json.dumps(f.get('parameters') or {'type': 'object'}, ensure_ascii=False)}")
    if fmt is not None:
        lines.append(f"To call one, write {fmt.call_text('name', {'parameter': 'value'})}")
    return "\n".join(lines)


class ToolCallReader:
    """Reads tool calls out of constrained text as it streams: `feed(text)` -> deltas `(index, name or None,
    arguments fragment)`, the first delta of a call carrying its name. In "named" mode without a format the whole
    text is the arguments of one call. In "required" mode without one the text is the grammar's array,
    `[{"name": "f", "arguments": ...}, ...]`: the layout is fixed and "arguments" is the last key, so a call's
    arguments are every character from after `"arguments": ` to the `}` that closes the call, found by following
    nesting outside strings. With a format, each call object is read the same way between the format's opening
    and closing texts, and the text before the first call is content (`take_content`), held back while it
    could still be the start of an opening text."""

    _KEY = '"arguments": '

    def __init__(self, plan: ToolPlan):
        self.format = plan.format
        self.named = plan.mode == "named" and self.format is None
        self.calls: list[dict] = [{"name": plan.names[0], "arguments": ""}] if self.named else []
        self._announced = 0       # calls whose name a delta has carried
        self._depth = 0           # 1 inside the array, 2 inside a call object, more inside its arguments
        self._in_string = self._escape = self._in_args = False
        self._head = ""           # a call object's text before its arguments
        self._fresh: dict[int, str] = {}     # arguments text added by the current feed, per call, in order
        self._closed = False                 # required mode: the array of calls has closed
        # with a format: "text" (before any call), "call" (inside a call object), "between" (after a call)
        self._where = "text"
        self._pending = ""                   # text not yet resolved: content or the start of an opening text
        self.content = ""                    # the text before the first call
        self._content_sent = 0

    def take_content(self) -> str:
        """Content added since the last call (with a format; always "" without)."""
        new = self.content[self._content_sent:]
        self._content_sent = len(self.content)
        return new

    def feed(self, text: str) -> list[tuple[int, str | None, str]]:
        if self.named:
            if text:
                self.calls[0]["arguments"] += text
                self._fresh[0] = text
        elif self.format is not None:
            self._feed_format(text)
        else:
            for ch in text:
                self._char(ch)
        out = []
        for i, frag in self._fresh.items():
            name = None
            if i >= self._announced:
                name, self._announced = self.calls[i]["name"], i + 1
            out.append((i, name, frag))
        self._fresh = {}
        return out

    def finish(self) -> None:
        """The text ended: what was held back as a possible opening text is content after all."""
        if self._where == "text":
            self.content += self._pending
            self._pending = ""

    def _feed_format(self, text: str) -> None:
        start = self.format.start
        for ch in text:
            if self._where == "call":
                self._char(ch)
                if self._depth == 1:                     # the call object closed
                    self._where, self._pending = "between", ""
                continue
            self._pending += ch
            if self._pending.endswith(start):
                if self._where == "text":
                    self.content += self._pending[:-len(start)]
                self._where, self._pending, self._depth = "call", "", 1
            elif self._where == "text":
                keep = next((k for k in range(min(len(start) - 1, len(self._pending)), 0, -1)
                             if start.startswith(self._pending[-k:])), 0)
                self.content += self._pending[:len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep:]

    @property
    def complete(self) -> bool:
        """Whether the text so far is whole calls (not cut by a length limit or a stop string)."""
        if self.format is not None:
            return bool(self.calls) and self._where == "between" and self._pending == self.format.end
        if not self.named:
            return self._closed
        try:
            json.loads(self.calls[0]["arguments"])
            return True
        except ValueError:
            return False

    def _char(self, ch: str) -> None:
        """One character of required-mode text: into the current call's arguments, or its head, or neither."""
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
            if self._depth == 2 and not self._in_args:
                self._head = ""
                return
        elif ch in "}]":
            self._depth -= 1
            self._closed = self._depth == 0
            if self._depth == 1 and self._in_args:          # the call object closes
                self._in_args = False
                return
        if self._in_args:
            i = len(self.calls) - 1
            self.calls[i]["arguments"] += ch
            self._fresh[i] = self._fresh.get(i, "") + ch
        elif self._depth == 2:
            self._head += ch
            if not self._in_string and self._head.endswith(self._KEY):
                name = json.loads("{" + self._head[:-len(", " + self._KEY)] + "}")["name"]
                self.calls.append({"name": name, "arguments": ""})
                self._in_args = True
