"""jevfmt: the prompt format of StartLux-Decision questions.

Wire format of one question (TypeSafe's `/v1/systemone`):

    {"type": "choice" | "noul" | "score", "question": str, "criteria": ...}      # type defaults to "choice"

- `choice`: `criteria` maps option ids to descriptions (an empty description shows the id).
- `noul`:   a yes/no question; the options are `true` ("Yes") and `false` ("No"); `criteria` is ignored.
- `score`:  `criteria` is a list, or a dict, of level descriptions; the options are the levels 0..n-1.

A request is `{"state": ..., "questions": {key: question}}`. The state is shared by every question: a
string, or any JSON value, rendered as indented JSON.

A rendered prompt (the default template; a checkpoint may declare its own in `decision_config.json`
under `"template"`, with the same keys) is:

    State:
    <state>

    Question: <question>
    Options:
    A. <option text>
    B. <option text>
    Answer:

and the model's next token is the answer letter, written as `letter` says (`" A"` by default). The
prompt is tokenized in three segments (state block, state text, question block) so that cutting the
state never changes how the question and options are tokenized.

Too long for `max_length`: tokens are cut from the *start* of the state (its end, usually the most
recent part, is kept) and `[...]` marks the cut. When the question and options alone do not fit,
`PromptTooLong` is raised.
"""
from __future__ import annotations

import json
import string
from dataclasses import dataclass, field

MAX_OPTIONS = 26
LETTERS = string.ascii_uppercase
TYPES = ("choice", "noul", "score")

DEFAULT_TEMPLATE = {
    "state": "State:\n{state}\n\n",
    "question": "Question: {question}\nOptions:\n",
    "option": "{letter}. {text}\n",
    "answer": "Answer:",
    "letter": " {letter}",
    "cut_marker": "[...]",
    "noul_options": {"true": "Yes", "false": "No"},
    "score_option": "{level}: {text}",
}


class FormatError(ValueError):
    """A question or state that cannot be rendered."""


class PromptTooLong(FormatError):
    pass


@dataclass
class Option:
    id: str
    text: str           # as shown in the prompt
    label: str = ""     # score levels: the level's description (the answer's legend)


@dataclass
class Row:
    """One question ready to render: its type, text, the shared state (rendered) and its options."""

    type: str
    question: str
    state: str
    options: list[Option] = field(default_factory=list)


def template_from(config: dict | None) -> dict:
    tpl = dict(DEFAULT_TEMPLATE)
    tpl.update((config or {}).get("template", {}))
    unknown = set(tpl) - set(DEFAULT_TEMPLATE)
    if unknown:
        raise FormatError(f"decision_config.json template: unknown keys {sorted(unknown)}")
    return tpl


def render_state(state) -> str:
    if state is None:
        return ""
    if isinstance(state, str):
        return state
    try:
        return json.dumps(state, indent=2, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise FormatError(f"state cannot be rendered as JSON: {e}") from None


def question_type(question: dict) -> str:
    t = question.get("type", "choice") if isinstance(question, dict) else None
    if t is None:
        t = "choice"
    if t not in TYPES:
        raise FormatError(f"unknown type {t!r}; expected one of {TYPES}")
    return t


def choice_criteria(question: dict) -> dict[str, str]:
    crit = question.get("criteria")
    if not isinstance(crit, dict) or not crit:
        raise FormatError("a choice question needs criteria: a non-empty object of option id -> description")
    for k, v in crit.items():
        if not isinstance(k, str) or not k:
            raise FormatError("choice option ids must be non-empty strings")
        if v is not None and not isinstance(v, str):
            raise FormatError(f"criteria[{k!r}] must be a string description")
    return crit


def score_levels(question: dict) -> list[str]:
    crit = question.get("criteria")
    levels = list(crit.values()) if isinstance(crit, dict) else crit
    if not isinstance(levels, list) or len(levels) < 2:
        raise FormatError("a score question needs criteria: a list (or object) of at least 2 level descriptions")
    if len(levels) > MAX_OPTIONS:
        raise FormatError(f"a score question has at most {MAX_OPTIONS} levels, got {len(levels)}")
    if any(not isinstance(v, str) for v in levels):
        raise FormatError("score level descriptions must be strings")
    return levels


def from_systemone(state, question: dict, template: dict | None = None, rendered_state: str | None = None) -> Row:
    """One wire-format question (and the request's state) -> a Row. Raises FormatError naming the problem."""
    tpl = template or DEFAULT_TEMPLATE
    if not isinstance(question, dict):
        raise FormatError("a question must be an object")
    t = question_type(question)
    text = question.get("question")
    if not isinstance(text, str) or not text.strip():
        raise FormatError("missing question text")
    st = rendered_state if rendered_state is not None else render_state(state)
    if t == "noul":
        opts = [Option(k, v) for k, v in tpl["noul_options"].items()]
    elif t == "score":
        opts = [Option(str(i), tpl["score_option"].format(level=i, text=d), d)
                for i, d in enumerate(score_levels(question))]
    else:
        opts = [Option(k, v or k) for k, v in choice_criteria(question).items()]
    return Row(t, text, st, opts)


@dataclass
class RenderInfo:
    letters: dict[str, str]       # answer letter -> option id
    state_tokens: int             # state tokens in the prompt
    state_tokens_cut: int         # tokens cut from the start of the state


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []


def render_ids(row: Row, tokenizer, order: list[str], max_length: int,
               template: dict | None = None) -> tuple[list[int], RenderInfo]:
    """The prompt ids for `row` with its options in `order` (ids), lettered A, B, C..., ending where the answer
    letter comes."""
    tpl = template or DEFAULT_TEMPLATE
    if len(order) > MAX_OPTIONS:
        raise FormatError(f"at most {MAX_OPTIONS} options per prompt, got {len(order)}")
    by_id = {o.id: o for o in row.options}
    body = tpl["question"].format(question=row.question)
    for letter, oid in zip(LETTERS, order):
        body += tpl["option"].format(letter=letter, text=by_id[oid].text)
    body += tpl["answer"]
    tail = _encode(tokenizer, body)
    letters = dict(zip(LETTERS, order))
    if not row.state:
        if len(tail) > max_length:
            raise PromptTooLong(f"the question and its options need {len(tail)} tokens; max_length is {max_length}")
        return tail, RenderInfo(letters, 0, 0)
    head_text, foot_text = tpl["state"].split("{state}")
    head, foot = _encode(tokenizer, head_text), _encode(tokenizer, foot_text)
    state = _encode(tokenizer, row.state)
    room = max_length - len(head) - len(foot) - len(tail)
    if len(state) <= room:
        return head + state + foot + tail, RenderInfo(letters, len(state), 0)
    marker = _encode(tokenizer, tpl["cut_marker"])
    keep = room - len(marker)
    if keep < 0:
        raise PromptTooLong(f"the question and its options need {len(head) + len(foot) + len(tail) + len(marker)} "
                            f"tokens with the state cut away; max_length is {max_length}")
    kept = state[len(state) - keep:] if keep else []
    return head + marker + kept + foot + tail, RenderInfo(letters, keep, len(state) - keep)


def letter_token_ids(tokenizer, template: dict | None = None) -> list[int]:
    """The single-token ids of A..Z as they follow the prompt's end; FormatError names any that are not one token."""
    tpl = template or DEFAULT_TEMPLATE
    ids, bad = [], []
    for letter in LETTERS:
        toks = _encode(tokenizer, tpl["letter"].format(letter=letter))
        if len(toks) != 1:
            bad.append(letter)
        else:
            ids.append(toks[0])
    if bad:
        raise FormatError(f"answer letters {', '.join(repr(tpl['letter'].format(letter=b)) for b in bad)} are not "
                          f"single tokens in this tokenizer")
    return ids


check_tokenizer = letter_token_ids
