"""jevfmt: the prompt format of StartLux-Decision questions, from System One's wire format.

A request is `{"model"?, "state": any JSON, "questions": {name: question}, "assets"?}`; a question is

    {"type": "choice" | "noul" | "score", "instructions": str | JSON | null, "criteria": ...}   # type: "choice"

- `choice`: `criteria` maps option ids to descriptions: a string, any JSON value (shown as JSON text) or
  null (the option shows its id).
- `noul`:   a yes/no question; the options are `true` ("Yes") and `false` ("No"). `criteria` is optional:
  `{"true": description, "false": description}` shows them as "Yes: <description>" / "No: <description>".
- `score`:  `criteria` is a list of level descriptions, lowest first (an object's values are taken in
  order); the options are the levels 0..n-1.

`instructions` given as JSON is shown as JSON text; null or absent shows no instruction line. `question` is
accepted as an older name for `instructions` (both at once is an error). Other keys are ignored. The state
is a string, or any JSON value, rendered as indented JSON.

A rendered prompt (the default template; a checkpoint may declare its own in `decision_config.json` under
`"template"`, with the same keys) is:

    State:
    <state>

    Question: <instructions>
    Options:
    A. <option text>
    B. <option text>
    Answer:

("Options:" alone opens the block when there are no instructions), and the model's next token is the
answer letter, written as `letter` says (`" A"` by default). The prompt is tokenized in three segments
(state block, state text, question block) so that cutting the state never changes how the question and
options are tokenized.

Too long for `max_length`: tokens are cut from the *start* of the state (its end, usually the most recent
part, is kept) and `[...]` marks the cut. When the question and options alone do not fit, `QuestionTooLong`
is raised.
"""
from __future__ import annotations

import json
import string
from dataclasses import dataclass, field

from .protocol import DecisionRequest, DecisionValidationError, Invalid, Option, Question

MAX_OPTIONS = 26
LETTERS = string.ascii_uppercase
TYPES = ("choice", "noul", "score")

DEFAULT_TEMPLATE = {
    "state": "State:\n{state}\n\n",
    "question": "Question: {question}\nOptions:\n",
    "no_question": "Options:\n",
    "option": "{letter}. {text}\n",
    "answer": "Answer:",
    "letter": " {letter}",
    "cut_marker": "[...]",
    "noul_options": {"true": "Yes", "false": "No"},
    "noul_option": "{label}: {text}",
    "score_option": "{level}: {text}",
}


class FormatError(ValueError):
    """A question or state that cannot be rendered."""


class QuestionTooLong(FormatError):
    """The question block (question and options) does not fit max_length, even with the state cut away."""


@dataclass
class Row:
    """One question ready to render: its type, text, the shared state (rendered) and its options."""

    type: str
    question: str       # the instructions as shown ("" shows no instruction line)
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


EXAMPLES = {
    "choice": '{"type": "choice", "instructions": "Which fits?", "criteria": {"a": "first", "b": "second"}}',
    "noul": '{"type": "noul", "instructions": "Is it so?", "criteria": {"true": "it is", "false": "it is not"}}',
    "score": '{"type": "score", "instructions": "How much?", "criteria": ["none", "some", "all"]}',
}


def as_text(value) -> str:
    """A description or instructions as shown in the prompt: a string as it is, any other JSON value as JSON text
    on one line."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise FormatError(f"not a JSON value: {e}") from None


def question_type(question: dict) -> str:
    t = question.get("type", "choice") if isinstance(question, dict) else None
    if t is None:
        t = "choice"
    if t not in TYPES:
        raise FormatError(f"unknown type {t!r}; expected one of {TYPES}")
    return t


def instructions(question: dict) -> str:
    """The question's instructions as shown ("" for none). `question` is the older name of `instructions`."""
    if "instructions" in question and "question" in question:
        raise FormatError("give `instructions` or its older name `question`, not both")
    value = question.get("instructions", question.get("question"))
    return "" if value is None else as_text(value)


def choice_criteria(question: dict) -> dict[str, str]:
    """Option id -> the text shown for it."""
    crit = question.get("criteria")
    if not isinstance(crit, dict) or not crit:
        raise FormatError("a choice question needs criteria: a non-empty object of option id -> description")
    if any(not k for k in crit):
        raise FormatError("choice option ids must be non-empty strings")
    return {k: as_text(v) if v not in (None, "") else k for k, v in crit.items()}


def noul_descriptions(question: dict) -> dict[str, str]:
    """`true`/`false` -> the description shown next to Yes/No ("" for none)."""
    crit = question.get("criteria")
    if crit is None:
        return {"true": "", "false": ""}
    if not isinstance(crit, dict) or set(crit) - {"true", "false"}:
        raise FormatError('noul criteria, when given, are {"true": description, "false": description}')
    return {k: "" if crit.get(k) is None else as_text(crit[k]) for k in ("true", "false")}


def score_levels(question: dict) -> list:
    """The level descriptions, lowest first, as the client sent them."""
    crit = question.get("criteria")
    levels = list(crit.values()) if isinstance(crit, dict) else crit
    if not isinstance(levels, list) or len(levels) < 2:
        raise FormatError("a score question needs criteria: a list of at least 2 level descriptions, lowest first")
    if len(levels) > MAX_OPTIONS:
        raise FormatError(f"a score question has at most {MAX_OPTIONS} levels, got {len(levels)}")
    if any(v is None for v in levels):
        raise FormatError("score level descriptions must be strings or JSON values, not null")
    return levels


def parse_question(question, template: dict | None = None) -> Question:
    """One wire-format question -> its parsed form (what the prompt shows of it). Raises FormatError naming the
    problem and showing what a valid question of its type looks like."""
    tpl = template or DEFAULT_TEMPLATE
    if not isinstance(question, dict):
        raise FormatError(f"a question must be an object, such as {EXAMPLES['choice']}")
    t = question_type(question)
    try:
        text = instructions(question)
        if t == "noul":
            desc = noul_descriptions(question)
            opts = [Option(k, tpl["noul_option"].format(label=label, text=desc[k]) if desc.get(k) else label)
                    for k, label in tpl["noul_options"].items()]
        elif t == "score":
            opts = [Option(str(i), tpl["score_option"].format(level=i, text=as_text(d)), d)
                    for i, d in enumerate(score_levels(question))]
        else:
            opts = [Option(k, v) for k, v in choice_criteria(question).items()]
    except FormatError as e:
        raise FormatError(f"{e} (a {t} question looks like {EXAMPLES[t]})") from None
    return Question(t, text, tuple(opts))


def parse_request(state, questions, template: dict | None = None) -> DecisionRequest:
    """A request's state (rendered once) and each of its questions parsed once; a question that does not parse
    is kept as `Invalid` (the scorer names it with the others it refuses). DecisionValidationError for a state
    that cannot be rendered or questions that are not a non-empty object."""
    if not isinstance(questions, dict) or not questions:
        raise DecisionValidationError({"questions": "must be a non-empty object of key -> question"})
    try:
        state_text = render_state(state)
    except FormatError as e:
        raise DecisionValidationError({"state": str(e)}) from None
    parsed: dict = {}
    for key, q in questions.items():
        try:
            parsed[key] = parse_question(q, template)
        except FormatError as e:
            parsed[key] = Invalid(str(e))
    return DecisionRequest(state_text, parsed)


def row_of(question: Question, state: str) -> Row:
    return Row(question.type, question.instructions, state, list(question.options))


def from_systemone(state, question: dict, template: dict | None = None, rendered_state: str | None = None) -> Row:
    """One wire-format question (and the request's state) -> a Row. Raises FormatError as parse_question."""
    parsed = parse_question(question, template)
    return row_of(parsed, rendered_state if rendered_state is not None else render_state(state))


@dataclass
class RenderInfo:
    letters: dict[str, str]       # answer letter -> option id
    state_tokens: int             # state tokens in the prompt
    state_tokens_cut: int         # tokens cut from the start of the state


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []


def render_tail(row: Row, tokenizer, order: list[str], template: dict | None = None) -> list[int]:
    """The question block's ids: the instructions, the options in `order` (ids) lettered A, B, C..., and the
    answer cue, ending where the answer letter comes. Tokenized apart from the state, so it is the same whatever
    state precedes it."""
    tpl = template or DEFAULT_TEMPLATE
    if len(order) > MAX_OPTIONS:
        raise FormatError(f"at most {MAX_OPTIONS} options per prompt, got {len(order)}")
    by_id = {o.id: o for o in row.options}
    body = tpl["question"].format(question=row.question) if row.question else tpl["no_question"]
    for letter, oid in zip(LETTERS, order):
        body += tpl["option"].format(letter=letter, text=by_id[oid].text)
    body += tpl["answer"]
    return _encode(tokenizer, body)


@dataclass
class StateBlock:
    """A request's state, tokenized once: the template's head and foot around the state's own tokens."""

    head: list[int]
    state: list[int]
    foot: list[int]
    marker: list[int]

    @classmethod
    def of(cls, state_text: str, tokenizer, template: dict | None = None) -> "StateBlock":
        tpl = template or DEFAULT_TEMPLATE
        if not state_text:
            return cls([], [], [], [])
        head_text, foot_text = tpl["state"].split("{state}")
        return cls(_encode(tokenizer, head_text), _encode(tokenizer, state_text), _encode(tokenizer, foot_text),
                   _encode(tokenizer, tpl["cut_marker"]))

    @property
    def shortest(self) -> int:
        """The fewest tokens the block can be cut to: the whole state if it is shorter than the cut marker."""
        if not self.state:
            return 0
        return len(self.head) + len(self.foot) + min(len(self.state), len(self.marker))

    def ids(self, room: int) -> tuple[list[int], int]:
        """The state block in at most `room` tokens, and how many state tokens were cut from its start (a
        marker shows the cut). QuestionTooLong when not even the marker fits."""
        if not self.state:
            if room < 0:
                raise QuestionTooLong(f"the question and its options need {-room} tokens more than max_length")
            return [], 0
        frame = len(self.head) + len(self.foot)
        if frame + len(self.state) <= room:
            return self.head + self.state + self.foot, 0
        keep = room - frame - len(self.marker)
        if keep < 0:
            raise QuestionTooLong(f"the question and its options need {frame + len(self.marker) - room} tokens more "
                                f"than max_length leaves them with the state cut away")
        kept = self.state[len(self.state) - keep:] if keep else []
        return self.head + self.marker + kept + self.foot, len(self.state) - keep


def render_ids(row: Row, tokenizer, order: list[str], max_length: int,
               template: dict | None = None) -> tuple[list[int], RenderInfo]:
    """The whole prompt for `row` with its options in `order` (ids): the state block, cut from its start to fit
    `max_length`, then the question block."""
    tail = render_tail(row, tokenizer, order, template)
    block = StateBlock.of(row.state, tokenizer, template)
    try:
        prefix, cut = block.ids(max_length - len(tail))
    except QuestionTooLong:
        raise QuestionTooLong(f"the question and its options need {len(tail)} tokens (with the state cut away, "
                            f"more); max_length is {max_length}") from None
    return prefix + tail, RenderInfo(dict(zip(LETTERS, order)), len(block.state) - cut, cut)


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
