"""The committed demo models answer: quality bars on held-out questions (a different seed than training).

These double as end-to-end checks of the prompter, the engine (batching, greedy decoding, tool forcing)
and the decision path (prompt format, padding, batching): a regression in any of them costs accuracy.
"""
import itertools
import json
import random
from pathlib import Path

import pytest

from core.chat import ChatPrompter, LLMEngine, SamplingParams, load_chat_defaults, load_chat_model
from core.decision import StartLuxDecision
from tools import demo_data as D

MODELS = Path(__file__).resolve().parent.parent / "models"


def load_demo_chat(path: str):
    """The demo chat model in the dtype the service's default (chat_dtype auto) picks on this machine: the bars
    hold where the service runs it."""
    import torch

    from core.chat.weights import chat_dtype

    return load_chat_model(path, device="cpu", dtype=chat_dtype("auto", torch.device("cpu"))[0])
HELD_OUT_SEED = 1234


@pytest.fixture(scope="module")
def chat_answers():
    path = str(MODELS / "demo-chat")
    model, tok, cfg = load_demo_chat(path)
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


def test_the_gpt2_demo_model_names_the_capitals():
    """models/demo-gpt2, serve_config.models.yaml's second chat model: capitals on held-out questions."""
    path = str(MODELS / "demo-gpt2")
    model, tok, cfg = load_demo_chat(path)
    assert cfg.arch == "gpt2"
    prompter = ChatPrompter(tok, cfg.sequence_len, load_chat_defaults(path).fewshot)
    engine = LLMEngine(model, tok, max_rows=32, prefix_ids=prompter.prefix_ids)
    cases = D.eval_questions(HELD_OUT_SEED, 60, "fact")
    for i, (msgs, _) in enumerate(cases):
        engine.add_request(prompter.render(msgs, 32).ids, SamplingParams(max_tokens=32, temperature=0.0), str(i))
    texts: dict[str, str] = {}
    while engine.has_work():
        for ev in engine.step():
            if ev.segment == "text":
                texts[ev.request_id] = texts.get(ev.request_id, "") + ev.text
    right = [expected in texts.get(str(i), "") for i, (_, expected) in enumerate(cases)]
    assert sum(right) / len(right) >= 0.9, [(cases[i][0][-1]["content"], texts.get(str(i))) for i, ok in
                                           enumerate(right) if not ok][:5]


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


# ---- tools and JSON: the prompt the service builds (tools described in a system text), the grammar it enforces
def _run(engine, jobs: dict) -> dict:
    """jobs: key -> (prompt ids, SamplingParams) -> key -> generated text (each call's request ids its own)."""
    tag = f"run{next(_RUNS)}"
    for key, (ids, params) in jobs.items():
        engine.add_request(ids, params, f"{tag}/{key}")
    out = {f"{tag}/{key}": "" for key in jobs}
    while engine.has_work():
        for ev in engine.step():
            if ev.request_id in out:
                out[ev.request_id] += ev.text
    return {key: out[f"{tag}/{key}"] for key in jobs}


_RUNS = itertools.count()


@pytest.fixture(scope="module")
def demo_chat():
    path = str(MODELS / "demo-chat")
    model, tok, cfg = load_demo_chat(path)
    defaults = load_chat_defaults(path)
    prompter = ChatPrompter(tok, cfg.sequence_len, defaults.fewshot, defaults.tool_format)
    return LLMEngine(model, tok, max_rows=32, prefix_ids=prompter.prefix_ids), prompter, defaults.tool_format


def test_the_demo_chat_model_calls_the_tool_that_fits_and_answers_from_its_result(demo_chat):
    """Held-out questions with 1-3 of the demo's tools offered under tool_choice "auto": the model calls the
    tool that fits, with the argument from the question, or answers itself when none fits; given the tool's
    result in the next turn, it answers with it."""
    from core.chat.grammars import ToolCallReader, tool_plan, tools_text

    engine, prompter, fmt = demo_chat
    assert fmt is not None                        # the checkpoint declares its tool-call format
    cases = D.tool_eval_questions(HELD_OUT_SEED + 3, 60)
    plans, jobs = {}, {}
    for i, (tools, msgs, _, _) in enumerate(cases):
        plans[i] = tool_plan(tools, "auto", None, fmt)
        system = [{"role": "system", "content": tools_text(tools, fmt)}]
        jobs[i] = (prompter.render(system + msgs, 64).ids,
                   SamplingParams(max_tokens=64, temperature=0.0, grammar=plans[i].grammar))
    texts = _run(engine, jobs)
    called, right_args, plain, followups = 0, 0, 0, {}
    for i, (tools, msgs, name, x) in enumerate(cases):
        reader = ToolCallReader(plans[i])
        reader.feed(texts[i])
        reader.finish()
        if name is None:
            plain += not reader.calls and x in reader.content
            continue
        if [c["name"] for c in reader.calls] == [name] and reader.complete:
            called += 1
            param = D.TOOLS[name][1]
            right_args += json.loads(reader.calls[0]["arguments"]) == {param: x}
            result = D.tool_result(random.Random(i), name)
            call = {"id": "call_1", "type": "function", "function": {"name": name,
                                                                    "arguments": reader.calls[0]["arguments"]}}
            history = msgs + [{"role": "assistant", "content": "", "tool_calls": [call]},
                              {"role": "tool", "tool_call_id": "call_1", "content": result}]
            system = [{"role": "system", "content": tools_text(tools, fmt)}]
            followups[i] = (result, (prompter.render(system + history, 64).ids,
                                     SamplingParams(max_tokens=64, temperature=0.0, grammar=plans[i].grammar)))
    want_tool = sum(name is not None for _, _, name, _ in cases)
    assert called / want_tool >= 0.9 and right_args / want_tool >= 0.9, (called, right_args, want_tool)
    assert plain / (len(cases) - want_tool) >= 0.8, plain
    answers = _run(engine, {i: job for i, (_, job) in followups.items()})
    answered = sum(result in answers[i] and "<tool_call>" not in answers[i] for i, (result, _) in followups.items())
    assert answered / len(followups) >= 0.9, answered


def test_the_demo_chat_model_fills_json_with_what_it_knows(demo_chat):
    """Capital questions under a JSON schema (the question does not mention JSON: the grammar writes the keys)
    and under json_object with the keys named in the question: the right values, and a closed object."""
    from core.chat.grammars import response_format_grammar

    engine, prompter, _ = demo_chat
    rng = random.Random(HELD_OUT_SEED + 5)
    jobs, expected = {}, {}
    for i in range(40):
        country = rng.choice(list(D.CAPITALS))
        keys = rng.choice(D.JSON_KEYS)
        q = rng.choice(D.FACT_TEMPLATES).format(c=country)
        if i % 2:
            fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
                "type": "object", "properties": {k: {"type": "string"} for k in keys}, "required": list(keys),
                "additionalProperties": False}}}
        else:
            fmt = {"type": "json_object"}
            q += f" Give it as JSON with keys {' and '.join(keys)}."
        jobs[i] = (prompter.render([{"role": "user", "content": q}], 64).ids,
                   SamplingParams(max_tokens=64, temperature=0.0, grammar=response_format_grammar(fmt)))
        expected[i] = json.loads(D.json_reply(keys, country))
    texts = _run(engine, jobs)
    wrong = [(texts[i], expected[i]) for i in jobs if _json(texts[i]) != expected[i]]
    assert len(wrong) / len(jobs) <= 0.1, wrong[:5]


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


@pytest.mark.parametrize("later_phases", [False, True], ids=["phase-1", "later-phases"])
def test_the_held_out_sets_are_apart_from_the_training_data(later_phases, monkeypatch):
    """tools/demo_heldout.py (#54): no question of its sets is one the training generator writes, none of its
    tools is a training tool, none of its key sets a training key set, none of its results' words a made-up word
    of training (also once the later phases build words of the tokenizer's pieces); and each arithmetic
    question's value is the calculator's for the expression meant (checked here by Python on the operands read
    back from the question)."""
    import re

    from core.chat.checkpoint import load_chat_tokenizer
    from tools import demo_heldout as H

    for name in ("PIECES", "RESERVED"):     # use_vocabulary's state, restored after
        monkeypatch.setattr(D, name, getattr(D, name).copy())
    if later_phases:
        D.use_vocabulary(load_chat_tokenizer(str(MODELS / "demo-chat"))[0])
        assert len(D.PIECES) > 500
    rng = random.Random(7)
    trained = set()
    for _ in range(3000):
        msgs, _ = D.conversation(rng)
        _, tool_msgs, _ = D.tool_conversation(rng)
        for m in msgs + tool_msgs + D.json_conversation(rng):
            if m["role"] == "user":
                trained.add(m["content"])
    math = H.arithmetic_questions(H.SEEDS["arithmetic"], 200)
    tools = H.tool_result_cases(H.SEEDS["tool_results"], 60)
    keys = H.json_key_cases(H.SEEDS["json_keys"], 60)
    asked = [q for q, _ in math] + [m[0]["content"] for _, m, _ in tools] + [q for q, _ in keys]
    assert not trained & set(asked)
    made_tools, made_keys, made_words = set(), set(), set()
    for _ in range(3000):
        made_tools.add(D.any_tool(rng)[0]["function"]["name"])
        made_keys.update(json.loads(D.any_json_conversation(rng)[1]["content"]))
        made_words.update(re.findall(r"[a-z]+", D.any_result(rng).lower()))
    assert not set(H.NEW_TOOLS) & (set(D.TOOLS) | made_tools)
    assert not {frozenset(k) for k in H.KEY_SETS} & {frozenset(k) for k in D.JSON_KEYS}
    held_keys = {k for ks in H.KEY_SETS for k in ks}
    # the keys of any kind that training names: none of the held-out ones but those the capitals' JSON always had
    assert held_keys & made_keys <= {k for ks in D.JSON_KEYS for k in ks}, held_keys & made_keys
    if later_phases:        # (phase 1 trains on conversations without tools: no made-up word; only the
        # tokenizer's text has them)
        assert not made_words & {w.lower() for w in H.WORDS_POOL + H.FIRST + H.LAST}
    words = {"plus": "+", "minus": "-", "times": "*", "multiplied by": "*", "divided by": "/", "over": "/",
             "x": "*", "×": "*"}
    checked = 0
    for q, value in math:
        for verb, op, swap in (("add", "+", False), ("sum", "+", False), ("subtract", "-", True),
                               ("take", "-", True), ("multiply", "*", False), ("divide", "/", False)):
            if f" {verb} " in f" {q.lower()} ":
                a, b = map(int, re.findall(r"\d+", q)[:2])
                expr = f"{b}{op}{a}" if swap else f"{a}{op}{b}"
                break
        else:
            expr = q
            for word, op in words.items():
                expr = expr.replace(f" {word} ", op)
            expr = "".join(ch for ch in expr.replace("x", "*").replace("×", "*") if ch in "0123456789+-*/")
        got = eval(expr)                                             # noqa: S307 - digits and operators only
        assert float(value) == (int(got) if float(got).is_integer() else got), (q, expr, value)
        checked += 1
    assert checked == len(math)
    forms = {"spaced": any(re.search(r"\d [-+*/x×] \d", q) for q, _ in math),
             "unspaced": any(re.search(r"\d[-+*/x×]\d", q) for q, _ in math),
             "x": any(re.search(r"\d ?[x×] ?\d", q) for q, _ in math),
             "words": all(any(f" {w} " in q for q, _ in math) for w in ("plus", "minus", "times", "divided by")),
             "verbs": all(any(v in q.lower() for q, _ in math) for v in ("add ", "subtract ", "multiply ", "divide ")),
             "chains": any(len(re.findall(r"[-+*]", q.replace("?", ""))) >= 2 for q, _ in math),
             "four digits": any(re.search(r"\d{4}", q) for q, _ in math)}
    assert all(forms.values()), forms


def test_the_demo_chat_model_has_the_skills_on_held_out_sets():
    """tools/demo_heldout.py's sets (another generator than the training data's: other phrasings, tools, result
    formats and keys), in the dtype the service picks here, with margin below what was measured (another CPU's
    rounding may flip a near tie): arithmetic as people type it at 90% (measured 59/60 in fp32, 60/60 in bf16),
    a new tool's result copied as given at 90% (measured 58/60 in both), JSON with the keys a request names at
    85% (measured 55/60 in both; #54's bar is 90%)."""
    from tools import demo_heldout as H

    results = H.evaluate(str(MODELS / "demo-chat"), "auto", 60)
    bars = {"arithmetic": 0.9, "tool_results": 0.9, "json_keys": 0.85}
    low = {name: (results[name]["right"], results[name]["wrong"][:3]) for name, bar in bars.items()
           if results[name]["right"] < bar * results[name]["total"]}
    assert not low, low
