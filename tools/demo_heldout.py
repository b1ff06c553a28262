"""Held-out questions for the demo chat model, from a generator of their own (#54).

    python -m tools.demo_heldout [--model models/demo-chat] [--dtype auto|float32|bfloat16] [--weights dtype|int8]
                                 [--n 60] [--show 5]

Nothing here is shared with the training data's generator (tools/demo_data.py): other phrasings, other tools,
other result formats, other JSON keys, written before the model that is measured on them was trained and never
trained on. Three sets, each answered greedily through the code the service runs (the checkpoint's prompter
with its few-shot priming, the engine with the calculator, the tool-call grammar and reader, the JSON grammar):

- `arithmetic`: arithmetic as people type it: symbols with and without spaces, `x`, words (plus, minus,
  times, divided by), "add A and B", "subtract A from B", "multiply A by B", "divide A by B", chains of two
  operators; integers up to four digits. Right when the answer's text holds the value the calculator gives
  for the expression meant.
- `tool_results`: a function tool the model never saw (one of several, with its own argument), already
  called; its result (random words, numbers with units, times, prices, names, short lists) comes back as the
  next turn. Right when the answer holds the result exactly as the tool gave it and calls no tool again.
- `json_keys`: a request under `response_format: json_object` that names the keys it wants (keys the
  training data never used). Right when the reply is one JSON object with exactly those keys, in any order.

Each set's questions come from its own seed (`SEEDS`); `evaluate` returns every set's right answers and the
wrong ones, which tests/test_demo_models.py holds to the bars and docs/demo-models.md quotes.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import string

SEEDS = {"arithmetic": 54_001, "tool_results": 54_002, "json_keys": 54_003}

# ---- arithmetic as people type it
SYMBOL_FORMS = ["{a} {op} {b}", "{a}{op}{b}"]
SYMBOLS = {"+": ["+"], "-": ["-"], "*": ["*", "x", "×"], "/": ["/"]}
WORDS = {"+": ["plus"], "-": ["minus"], "*": ["times", "multiplied by"], "/": ["divided by", "over"]}
VERBS = {"+": ["add {a} and {b}", "add {a} to {b}", "sum {a} and {b}"],
         "-": ["subtract {b} from {a}", "take {b} away from {a}"],
         "*": ["multiply {a} by {b}", "multiply {a} and {b}"],
         "/": ["divide {a} by {b}"]}
ASK = ["What is {e}?", "what is {e}", "What's {e}?", "{e} = ?", "{e}=?", "{e}?", "Calculate {e}.", "calc {e}",
       "How much is {e}?", "Can you work out {e}?", "Quick one: {e}", "Solve {e}", "I need {e}, please.",
       "tell me {e}"]
ASK_VERB = ["{v}.", "{V}.", "Please {v}.", "Can you {v}?", "{V} for me.", "Could you {v}, please?"]


def _operands(rng: random.Random, op: str) -> tuple[int, int]:
    """Integers up to four digits; a division comes out whole or in halves or quarters (what the calculator
    writes in a few digits)."""
    size = lambda: rng.randint(0, 10 ** rng.randint(1, 4) - 1)    # noqa: E731
    if op == "/":
        b = rng.choice([2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 15, 16, 20, 25, 50, 100])
        a = rng.randint(1, 9999 // b - 1) * b
        if b % 4 == 0 and rng.random() < 0.3:
            a += rng.choice([b // 2, b // 4])
        return a, b
    if op == "*":
        return size(), rng.randint(0, 999)
    a, b = size(), size()
    if op == "-" and rng.random() < 0.7:
        a, b = max(a, b), min(a, b)
    return a, b


def _value(expr: str) -> str:
    from core.chat.calculator import format_result, use_calculator

    value = use_calculator(expr)
    assert value is not None, expr
    return format_result(value)


def arithmetic_questions(seed: int, n: int) -> list[tuple[str, str]]:
    """(question, the value its answer must hold)."""
    rng, out = random.Random(seed), []
    for i in range(n):
        form = i % 4
        if form == 3:                                   # a chain of two operators, in symbols
            ops = [rng.choice("+-*"), rng.choice("+-*")]
            a, b, c = rng.randint(1, 999), rng.randint(1, 99), rng.randint(1, 99)
            expr = f"{a}{ops[0]}{b}{ops[1]}{c}"
            spaced = rng.random() < 0.5
            shown = expr if not spaced else f"{a} {ops[0]} {b} {ops[1]} {c}"
            out.append((rng.choice(ASK).format(e=shown), _value(expr)))
            continue
        op = rng.choice("+-*/")
        a, b = _operands(rng, op)
        if form == 0:                                   # symbols, with or without spaces
            shown = rng.choice(SYMBOL_FORMS).format(a=a, op=rng.choice(SYMBOLS[op]), b=b)
            q = rng.choice(ASK).format(e=shown)
        elif form == 1:                                 # words
            q = rng.choice(ASK).format(e=f"{a} {rng.choice(WORDS[op])} {b}")
        else:                                           # a verb: add A and B, subtract B from A, ...
            v = rng.choice(VERBS[op]).format(a=a, b=b)
            q = rng.choice(ASK_VERB).format(v=v, V=v[0].upper() + v[1:])
        out.append((q, _value(f"{a}{op}{b}")))
    return out


# ---- tool results, copied as given
NEW_TOOLS = {   # name -> (description, parameter, question template, what the questions ask about)
    "lookup": ("Look something up.", "query", "Can you look up {x}?",
               ["the harbour", "Lisbon", "the Eiffel Tower", "quantum dots", "the city museum"]),
    "get_stock_price": ("The latest price of a stock.", "symbol", "What does {x} trade at?",
                        ["ACME", "TSLA", "NVDA", "Globex", "Initech"]),
    "opening_hours": ("When a place is open.", "place", "When is the {x} open?",
                      ["museum", "library", "bakery", "station", "harbour office"]),
    "find_author": ("Who wrote a book.", "title", "Who wrote {x}?", ["Hamlet", "Moby Dick", "Dune", "Emma"]),
    "distance_to": ("How far a place is from here.", "destination", "How far is it to {x}?",
                    ["Oslo", "the station", "the coast", "Lyon", "the airport"]),
    "check_inventory": ("What is in stock.", "item", "Do we have any {x} left?",
                        ["blue pens", "bananas", "printer paper", "AA batteries", "coffee"]),
    "translate_word": ("Translate a word into French.", "word", "How do you say {x} in French?",
                       ["apple", "house", "river", "bread", "window"]),
    "convert_currency": ("Convert an amount of money.", "amount", "How much is {x} in euros?",
                         ["100 dollars", "50 pounds", "2000 yen", "75 francs", "12 dollars"]),
}
FIRST = ["Ada", "Omar", "Mei", "Lucia", "Kwame", "Ingrid", "Ravi", "Sofia", "Tomasz", "Yuki"]
LAST = ["Lovelace", "Haddad", "Chen", "Moreno", "Mensah", "Berg", "Patel", "Rossi", "Nowak", "Tanaka"]
WORDS_POOL = ["marble", "velvet", "lantern", "copper", "thistle", "harbor", "quartz", "meadow", "ember", "saffron",
              "orchid", "granite", "willow", "cobalt", "juniper", "pebble"]
UNITS = ["km", "m", "kg", "g", "L", "ml", "metres", "miles", "C", "%", "people", "items", "hours", "minutes"]


def _result(rng: random.Random) -> str:
    kind = rng.randrange(8)
    if kind == 0:                                       # random words
        return " ".join(rng.sample(WORDS_POOL, rng.randint(1, 3)))
    if kind == 1:                                       # a number with a unit
        n = rng.choice([str(rng.randint(1, 9999)), f"{rng.randint(0, 999)}.{rng.randint(0, 9)}"])
        return f"{'about ' if rng.random() < 0.3 else ''}{n} {rng.choice(UNITS)}"
    if kind == 2:                                       # a time
        return rng.choice([f"{rng.randint(0, 23):02d}:{rng.choice([0, 15, 30, 45]):02d}",
                           f"open until {rng.randint(12, 23)}:{rng.choice(['00', '30'])}",
                           f"{rng.randint(1, 12)} {rng.choice(['am', 'pm'])}"])
    if kind == 3:                                       # a price
        amount = f"{rng.randint(0, 999)}.{rng.randint(0, 99):02d}"
        return rng.choice([f"{amount} EUR", f"${amount}", f"{amount} USD", f"£{amount}"])
    if kind == 4:                                       # a name
        return f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    if kind == 5:                                       # a short list
        return ", ".join(rng.sample(WORDS_POOL, rng.randint(2, 4)))
    if kind == 6:                                       # a code-like token
        return "".join(rng.choice(string.ascii_uppercase + string.digits) for _ in range(rng.randint(4, 8)))
    return f"{rng.choice(WORDS_POOL)}, {rng.randint(-20, 40)} C"


def new_tool(name: str) -> dict:
    description, param, _, _ = NEW_TOOLS[name]
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {param: {"type": "string"}}, "required": [param]}}}


def tool_result_cases(seed: int, n: int) -> list[tuple[list[dict], list[dict], str]]:
    """(tools offered, the conversation up to and with the tool's result, the result)."""
    rng, out = random.Random(seed), []
    names = list(NEW_TOOLS)
    for i in range(n):
        name = names[i % len(names)]
        others = rng.sample([x for x in names if x != name], rng.randint(0, 2))
        tools = [new_tool(x) for x in rng.sample([name] + others, len(others) + 1)]
        _, param, question, subjects = NEW_TOOLS[name]
        x = rng.choice(subjects)
        result = _result(rng)
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": name, "arguments": json.dumps({param: x})}}
        msgs = [{"role": "user", "content": question.format(x=x)},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"call_{i}", "content": result}]
        out.append((tools, msgs, result))
    return out


# ---- JSON with the keys a request names
KEY_SETS = [("town", "region"), ("name", "population"), ("animal", "sound"), ("title", "author"),
            ("colour", "fruit"), ("language", "greeting"), ("river", "length"), ("planet", "moons"),
            ("first_name", "last_name"), ("item", "price", "currency"), ("team", "score"), ("word", "meaning")]
JSON_TOPICS = ["Paris", "a cat", "a famous book", "the Nile", "Mars", "a football match", "a shop item",
               "a friendly greeting", "a random person", "Japan", "a fruit", "an English word"]
JSON_FORMS = ["Give me JSON about {t} with the keys {k}.", "Describe {t} as a JSON object with keys {k}.",
              "Return JSON with fields {k} for {t}.", "{T} as JSON, keys: {k}.",
              "Make a JSON object for {t} using the keys {k}.", "JSON only, keys {k}, about {t}."]


def _keys_text(rng: random.Random, keys: tuple[str, ...]) -> str:
    quoted = [f'"{k}"' for k in keys] if rng.random() < 0.4 else list(keys)
    return ", ".join(quoted) if rng.random() < 0.5 else " and ".join([", ".join(quoted[:-1]), quoted[-1]])


def json_key_cases(seed: int, n: int) -> list[tuple[str, tuple[str, ...]]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        keys, topic = KEY_SETS[i % len(KEY_SETS)], rng.choice(JSON_TOPICS)
        q = rng.choice(JSON_FORMS).format(t=topic, T=topic[0].upper() + topic[1:], k=_keys_text(rng, keys))
        out.append((q, keys))
    return out


# ---- answering them through the service's code
def _run(engine, jobs: dict, counter=itertools.count()) -> dict[str, dict]:
    """key -> (prompt ids, SamplingParams) => key -> {"text": the reply's text, "parts": calculator parts}."""
    tag = f"heldout{next(counter)}"
    for key, (ids, params) in jobs.items():
        engine.add_request(ids, params, f"{tag}/{key}")
    out = {f"{tag}/{key}": {"text": "", "parts": ""} for key in jobs}
    while engine.has_work():
        for ev in engine.step():
            if ev.request_id in out:
                slot = out[ev.request_id]
                if ev.segment == "text":
                    slot["text"] += ev.text
                else:
                    slot["parts"] += f"[{ev.segment}]{ev.text}"
    return {key: out[f"{tag}/{key}"] for key in jobs}


def evaluate(model_dir: str, dtype: str = "auto", n: int = 60, weights: str = "dtype") -> dict[str, dict]:
    """Every set answered by the checkpoint in `dtype` (`weights` "int8": its linear layers' weights in int8, as
    `chat_weights: int8` serves it) -> set -> {"right", "total", "wrong": [(question, reply, wanted)]}."""
    import torch

    from core.chat import ChatPrompter, LLMEngine, SamplingParams, load_chat_defaults, load_chat_model
    from core.chat.grammars import ToolCallReader, response_format_grammar, tool_plan, tools_text
    from core.chat.weights import chat_dtype

    model, tok, cfg = load_chat_model(model_dir, device="cpu", dtype=chat_dtype(dtype, torch.device("cpu"))[0])
    defaults = load_chat_defaults(model_dir)
    prompter = ChatPrompter(tok, cfg.sequence_len, defaults.fewshot, defaults.tool_format)
    engine = LLMEngine(model, tok, max_rows=32, prefix_ids=prompter.prefix_ids, weights=weights)
    greedy = lambda **kw: SamplingParams(max_tokens=64, temperature=0.0, **kw)     # noqa: E731
    results = {}

    math = arithmetic_questions(SEEDS["arithmetic"], n)
    got = _run(engine, {i: (prompter.render([{"role": "user", "content": q}], 64).ids, greedy())
                        for i, (q, _) in enumerate(math)})
    results["arithmetic"] = _score([(q, got[i]["parts"] + " " + got[i]["text"], v, v in got[i]["text"])
                                    for i, (q, v) in enumerate(math)])

    fmt = defaults.tool_format
    cases = tool_result_cases(SEEDS["tool_results"], n)
    plans = {i: tool_plan(tools, "auto", None, fmt) for i, (tools, _, _) in enumerate(cases)}
    got = _run(engine, {i: (prompter.render([{"role": "system", "content": tools_text(tools, fmt)}] + msgs, 64).ids,
                            greedy(grammar=plans[i].grammar)) for i, (tools, msgs, _) in enumerate(cases)})
    rows = []
    for i, (_, msgs, result) in enumerate(cases):
        reader = ToolCallReader(plans[i])
        reader.feed(got[i]["text"])
        reader.finish()
        rows.append((msgs[0]["content"] + f" [tool: {result}]", got[i]["text"], result,
                     not reader.calls and result in reader.content))
    results["tool_results"] = _score(rows)

    keys = json_key_cases(SEEDS["json_keys"], n)
    grammar = response_format_grammar({"type": "json_object"})
    got = _run(engine, {i: (prompter.render([{"role": "user", "content": q}], 64).ids, greedy(grammar=grammar))
                        for i, (q, _) in enumerate(keys)})
    results["json_keys"] = _score([(q, got[i]["text"], list(k), _keys_of(got[i]["text"]) == set(k))
                                   for i, (q, k) in enumerate(keys)])
    return results


def _keys_of(text: str) -> set[str] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return set(value) if isinstance(value, dict) else None


def _score(rows: list[tuple[str, str, object, bool]]) -> dict:
    return {"right": sum(ok for *_, ok in rows), "total": len(rows),
            "wrong": [(q, reply, wanted) for q, reply, wanted, ok in rows if not ok]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="models/demo-chat")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--weights", default="dtype", choices=("dtype", "int8"), help="int8: as chat_weights: int8")
    p.add_argument("--n", type=int, default=60)
    p.add_argument("--show", type=int, default=5, help="wrong answers shown per set")
    args = p.parse_args()
    for name, r in evaluate(args.model, args.dtype, args.n, args.weights).items():
        print(f"{name}: {r['right']}/{r['total']}")
        for q, reply, wanted in r["wrong"][:args.show]:
            print(f"    {q!r} -> {reply!r} (wanted {wanted!r})")


if __name__ == "__main__":
    main()
