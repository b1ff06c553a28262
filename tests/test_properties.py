"""Property tests (hypothesis): the calculator, the chat prompter and the System One parser on arbitrary input."""
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.chat import SPECIAL_TOKENS, ChatPrompter
from core.chat.calculator import MAX_ABS, MAX_EXPR_CHARS, use_calculator
from core.chat.prompter import PromptError
from core.decision import jevfmt as J

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# expressions from the calculator's own alphabet, so that many of them parse
EXPR = st.text(alphabet="0123456789+-*/(). 'abcx", max_size=300) | st.text(max_size=300)
ARITH = st.recursive(st.integers(-10 ** 18, 10 ** 18).map(str) | st.floats(allow_nan=False).map(repr),
                     lambda inner: st.tuples(inner, st.sampled_from("+-*/"), inner).map(lambda t: f"({t[0]}{t[1]}{t[2]})"),
                     max_leaves=40)


@SETTINGS
@given(expr=EXPR | ARITH)
def test_calculator_answers_or_refuses_within_its_bounds(expr):
    value = use_calculator(expr)              # never raises: a refusal is None
    if value is not None:
        assert len(expr) <= MAX_EXPR_CHARS
        assert isinstance(value, (int, float)) and abs(value) <= MAX_ABS and value == value


TEXT = st.text(max_size=60) | st.sampled_from(SPECIAL_TOKENS).map(lambda s: f"x {s} y")
TURN = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": TEXT})


@SETTINGS
@given(history=st.lists(TURN, max_size=12), last=TEXT, max_new=st.integers(1, 120))
def test_prompter_never_emits_control_tokens_from_text_and_keeps_the_newest_turn(tokenizer, history, last, max_new):
    fewshot = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    prompter = ChatPrompter(tokenizer, 256, fewshot)
    messages = history + [{"role": "user", "content": last}]
    try:
        prompt = prompter.render(messages, max_new)
    except PromptError:
        return                                      # refused with a reason (the newest turn alone is too long)
    ids = prompt.ids
    special = {tokenizer.encode_special(s) for s in SPECIAL_TOKENS}
    kept = len(messages) - prompt.dropped_turns
    # control tokens are structure only: <|bos|>, a start and an end per turn (few-shot and kept), the cue;
    # none comes from the text, however it spells special tokens
    assert sum(1 for i in ids if i in special) == 1 + 2 * len(fewshot) + 2 * kept + 1
    assert ids[-1] == tokenizer.encode_special("<|assistant_start|>")
    newest = tokenizer.encode(last)
    assert ids[len(ids) - 2 - len(newest):-2] == newest    # the newest user turn is kept whole, before the cue
    assert len(ids) + max_new <= 256
    assert messages[prompt.dropped_turns]["role"] == "user"   # a kept history starts with a user turn


JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                                    max_size=4), max_leaves=12)
QUESTION = st.dictionaries(st.sampled_from(["type", "instructions", "question", "criteria", "proposition"]),
                           JSONISH | st.sampled_from(["choice", "noul", "score"]), max_size=5) | JSONISH


@SETTINGS
@given(state=JSONISH, question=QUESTION)
def test_system_one_parser_accepts_or_names_the_problem(state, question):
    try:
        row = J.from_systemone(state, question)
    except J.FormatError as e:
        assert str(e)                                # a refusal says why
        return
    assert row.type in J.TYPES and 1 <= len(row.options) <= J.MAX_OPTIONS or row.type == "choice"
    assert isinstance(row.question, str) and isinstance(row.state, str)
    for option in row.options:
        assert isinstance(option.text, str)
    json.dumps([o.label for o in row.options])      # the legend is JSON again
