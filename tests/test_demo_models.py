"""The committed demo models answer: quality bars on held-out questions (a different seed than training).

These double as end-to-end checks of the prompter, the engine (batching, greedy decoding, tool forcing)
and the decision path (prompt format, padding, batching): a regression in any of them costs accuracy.
"""
import random
from pathlib import Path

import pytest

from core.chat import ChatPrompter, LLMEngine, SamplingParams, load_chat_defaults, load_chat_model
from core.decision import StartLuxDecision
from tools import demo_data as D

MODELS = Path(__file__).resolve().parent.parent / "models"
HELD_OUT_SEED = 1234


@pytest.fixture(scope="module")
def chat_answers():
    path = str(MODELS / "demo-chat")
    model, tok, cfg = load_chat_model(path, device="cpu")
    prompter = ChatPrompter(tok, cfg.sequence_len, load_chat_defaults(path).fewshot)
    engine = LLMEngine(model, tok, max_rows=32, prefix_ids=prompter.prefix_ids)
    cases = {kind: D.eval_questions(HELD_OUT_SEED + i, 60, kind) for i, kind in enumerate(("fact", "math"))}
    texts, parts = {}, {}
    for kind, qs in cases.items():
        for i, (msgs, _) in enumerate(qs):
            engine.add_request(prompter.render(msgs, 48).ids, SamplingParams(max_tokens=48, temperature=0.0),
                               f"{kind}-{i}")
    while engine.has_work():
        for ev in engine.step():
            texts.setdefault(ev.request_id, "")
            parts.setdefault(ev.request_id, "")
            if ev.segment == "text":
                texts[ev.request_id] += ev.text
            parts[ev.request_id] += f"[{ev.segment}]{ev.text}" if ev.segment != "text" else ""
    return cases, texts, parts


@pytest.mark.parametrize("kind", ["fact", "math"])
def test_chat_demo_accuracy(chat_answers, kind):
    cases, texts, parts = chat_answers
    right = [expected in texts[f"{kind}-{i}"] for i, (_, expected) in enumerate(cases[kind])]
    wrong = [(cases[kind][i][0][-1]["content"], texts[f"{kind}-{i}"]) for i, ok in enumerate(right) if not ok]
    assert sum(right) / len(right) >= 0.9, wrong[:5]
    if kind == "math":   # the number comes from the calculator, which the model must call
        assert sum("[python_output]" in parts[f"math-{i}"] for i in range(len(right))) / len(right) >= 0.9


@pytest.fixture(scope="module")
def scorer():
    return StartLuxDecision(str(MODELS / "demo-decision"), device="cpu", max_batch_tokens=4096)


def decision_cases(n=60):
    rng = random.Random(HELD_OUT_SEED)
    cases = {}
    for name, task in D.DECISION_TASKS.items():
        cases[name] = [task(rng) for _ in range(n)]
    return cases


@pytest.mark.parametrize("name", ["choice_largest", "noul", "choice_category", "score"])
def test_decision_demo_accuracy(scorer, name):
    cases = decision_cases()[name]
    answers = scorer.decide_batch([(state, {"q": q}) for state, q, _ in cases])
    if name == "score":
        close = [abs(a["q"]["score"] - int(t)) <= 0.5 for a, (_, _, t) in zip(answers, cases)]
        assert sum(close) / len(close) >= 0.8
    elif name == "noul":
        right = [(a["q"]["noul"] > 0.5) == (t == "true") for a, (_, _, t) in zip(answers, cases)]
        assert sum(right) / len(right) >= 0.9
    else:
        right = [a["q"]["choice"] == t for a, (_, _, t) in zip(answers, cases)]
        assert sum(right) / len(right) >= 0.9


def test_decision_demo_tournament(scorer):
    rng = random.Random(HELD_OUT_SEED + 7)
    right = 0
    for _ in range(10):
        cat = rng.choice(list(D.CATEGORIES))
        answer = rng.choice(D.CATEGORIES[cat])
        others = [w for c in D.CATEGORIES if c != cat for w in D.CATEGORIES[c]]
        items = [answer] + rng.sample(others, 39)
        rng.shuffle(items)
        crit = {f"k{i}": w for i, w in enumerate(items)}
        answers, usage = scorer.decide("", {"q": {"instructions": f"Which option is a {cat}?", "criteria": crit}})
        assert len(answers["q"]["probabilities"]) == 40 and usage["input_tokens"] > 0
        right += answers["q"]["choice"] == f"k{items.index(answer)}"
    assert right >= 8
