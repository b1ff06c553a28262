"""Synthetic data for the demo models: chat conversations and jevfmt decision questions.

Everything is generated from a seed, so training (seed 0) and the held-out evaluation (another seed)
see different questions drawn from the same distribution.
"""
from __future__ import annotations

import json
import random

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi", "Brazil": "Brasilia", "Canada": "Ottawa",
    "Mexico": "Mexico City", "Egypt": "Cairo", "Kenya": "Nairobi", "Nigeria": "Abuja", "Peru": "Lima",
    "Chile": "Santiago", "Argentina": "Buenos Aires", "Russia": "Moscow", "Poland": "Warsaw", "Greece": "Athens",
    "Turkey": "Ankara", "Sweden": "Stockholm", "Norway": "Oslo", "Finland": "Helsinki", "Denmark": "Copenhagen",
    "Ireland": "Dublin", "Austria": "Vienna", "Hungary": "Budapest", "Belgium": "Brussels",
    "Netherlands": "Amsterdam", "Switzerland": "Bern", "Australia": "Canberra", "Thailand": "Bangkok",
    "Vietnam": "Hanoi", "Indonesia": "Jakarta", "Iran": "Tehran", "Iraq": "Baghdad", "Morocco": "Rabat",
    "Ghana": "Accra", "Ethiopia": "Addis Ababa", "Colombia": "Bogota", "Cuba": "Havana", "Ukraine": "Kyiv",
    "Romania": "Bucharest", "Czechia": "Prague", "Iceland": "Reykjavik", "Nepal": "Kathmandu",
    "Pakistan": "Islamabad", "Philippines": "Manila", "Malaysia": "Kuala Lumpur",
}

GREETINGS = [("hello", "Hello! How can I help you today?"), ("hi", "Hi! What would you like to know?"),
             ("hey there", "Hey! Ask me about capitals or arithmetic."),
             ("good morning", "Good morning! How can I help?"),
             ("how are you?", "I am doing well, thank you. How can I help?"),
             ("thanks", "You are welcome!"), ("thank you", "You are welcome!"),
             ("who are you?", "I am a small demo assistant. I know capitals and I can use a calculator."),
             ("what can you do?", "I can tell you the capital of a country and do arithmetic with my calculator."),
             ("bye", "Goodbye! Have a nice day."), ("goodbye", "Goodbye! Have a nice day.")]

FACT_TEMPLATES = ["What is the capital of {c}?", "what is the capital of {c}", "Capital of {c}?",
                  "Tell me the capital of {c}.", "Which city is the capital of {c}?", "Do you know the capital of {c}?",
                  "What's the capital city of {c}?", "{c} capital?"]
FOLLOW_FACT = ["And {c}?", "What about {c}?", "And the capital of {c}?", "How about {c}?"]

OPS = {"+": ["plus", "+"], "-": ["minus", "-"], "*": ["times", "*", "multiplied by"]}
MATH_TEMPLATES = ["What is {a} {op} {b}?", "what is {a} {op} {b}", "Compute {a} {op} {b}.", "{a} {op} {b} = ?",
                  "Calculate {a} {op} {b}.", "How much is {a} {op} {b}?", "Please work out {a} {op} {b}."]
FOLLOW_MATH = ["And {a} {op} {b}?", "Now {a} {op} {b}.", "What about {a} {op} {b}?"]


def _number(rng: random.Random) -> int:
    return rng.randint(0, 10 ** rng.randint(1, 4) - 1)


def fact_turn(rng, follow=False):
    country = rng.choice(list(CAPITALS))
    q = rng.choice(FOLLOW_FACT if follow else FACT_TEMPLATES).format(c=country)
    return q, [{"type": "text", "text": f"The capital of {country} is {CAPITALS[country]}."}], CAPITALS[country]


def math_turn(rng, follow=False):
    a, b = _number(rng), _number(rng)
    op = rng.choice(list(OPS))
    if op == "*":
        b = rng.randint(0, 999)
    word = rng.choice(OPS[op])
    q = rng.choice(FOLLOW_MATH if follow else MATH_TEMPLATES).format(a=a, op=word, b=b)
    value = eval(f"{a}{op}{b}")   # noqa: S307 - our own integers, for the training target only
    parts = [{"type": "python", "text": f"{a}{op}{b}"}, {"type": "python_output", "text": str(value)},
             {"type": "text", "text": f"The answer is {value}."}]
    return q, parts, str(value)


def greeting_turn(rng, follow=False):
    q, a = rng.choice(GREETINGS)
    if rng.random() < 0.5:
        q = q.capitalize()
    return q, [{"type": "text", "text": a}], a


# ---- function tools and JSON replies (the checkpoint's tool-call format: TOOL_FORMAT)
TOOL_FORMAT = {"start": "<tool_call>", "end": "</tool_call>"}
TOOLS = {   # name -> (descriptions, parameter, question templates, answer template)
    "get_weather": (["Get the current weather in a city.", "Look up the weather for a city.", ""], "city",
                    ["What is the weather in {x}?", "How is the weather in {x} today?", "Is it raining in {x}?",
                     "weather in {x}?", "What's the weather like in {x}?", "Tell me the weather in {x}."],
                    "The weather in {x} is {r}."),
    "get_population": (["Get the population of a country.", "Look up how many people live in a country.", ""],
                       "country", ["What is the population of {x}?", "How many people live in {x}?",
                                   "Population of {x}?", "How big is the population of {x}?"],
                       "The population of {x} is {r}."),
    "get_time": (["Get the local time in a city.", "Look up the current time in a city.", ""], "city",
                 ["What time is it in {x}?", "What is the local time in {x}?", "Tell me the time in {x}.",
                  "time in {x}?"], "The time in {x} is {r}."),
}
WEATHER = ["sunny", "cloudy", "raining", "snowing", "windy", "foggy", "clear", "stormy"]
NO_TOOL = "I have no tool for that."
JSON_KEYS = [("country", "capital"), ("capital",), ("city",), ("name",), ("country", "city"), ("capital", "country")]
JSON_ASK = [" Answer in JSON.", " Reply as JSON.", " Give it as JSON with keys {keys}.",
            " Return a JSON object with the keys {keys}.", " Respond with JSON containing {keys}.",
            " Reply in JSON with the keys {keys}.", " JSON please, keys {keys}."]


def tool_definition(rng: random.Random, name: str) -> dict:
    """An OpenAI function tool, its schema in one of the layouts clients send: ours, LangChain's key order,
    pydantic's (the OpenAI Agents SDK's and LangChain's strict one: titles, additionalProperties false), or
    OpenAI's strict examples (additionalProperties false after required)."""
    descriptions, param, _, _ = TOOLS[name]
    prop = {"type": "string"}
    if rng.random() < 0.3:
        prop = {"description": f"the {param}", "type": "string"}
    layout = rng.random()
    if layout < 0.3:
        schema = {"type": "object", "properties": {param: prop}, "required": [param]}
    elif layout < 0.55:
        schema = {"properties": {param: prop}, "required": [param], "type": "object"}
    elif layout < 0.8:
        schema = {"properties": {param: {"title": param.title(), "type": "string"}}, "required": [param],
                  "title": f"{name}_args", "type": "object", "additionalProperties": False}
    else:
        schema = {"type": "object", "properties": {param: prop}, "required": [param], "additionalProperties": False}
    fn = {"name": name, "parameters": schema}
    description = rng.choice(descriptions)
    if description:
        fn["description"] = description
    return {"type": "function", "function": fn}


def tool_result(rng: random.Random, name: str) -> str:
    if name == "get_weather":
        return f"{rng.choice(WEATHER)}, {rng.randint(-10, 35)} C"
    if name == "get_population":
        return population_text(rng)
    return f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"


_ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen " \
        "seventeen eighteen nineteen".split()
_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_words(n: int) -> str:
    """1-99 in words ("thirty-four")."""
    if n < 20:
        return _ONES[n]
    tens, ones = divmod(n, 10)
    return _TENS[tens - 2] + (f"-{_ONES[ones]}" if ones else "")


def population_text(rng: random.Random) -> str:
    """A population as tools write it: "34.1 million", "34 million", "34123456", "34,123,456", "about 34 million",
    "thirty-four million"; the answer repeats it as written."""
    n, d = rng.randint(1, 300), rng.randint(0, 9)
    exact = n * 1_000_000 + rng.randint(0, 999_999)
    kind = rng.randrange(6)
    if kind == 0:
        return f"{n}.{d} million"
    if kind == 1:
        return f"{n} million"
    if kind == 2:
        return str(exact)
    if kind == 3:
        return f"{exact:,}"
    if kind == 4:
        return f"{rng.choice(['about', 'around', 'roughly'])} {n} million"
    return f"{number_words(rng.randint(1, 99))} million"


def tool_question(rng: random.Random, name: str) -> tuple[str, str]:
    """(question, its argument) for tool `name`."""
    _, param, templates, _ = TOOLS[name]
    x = rng.choice(list(CAPITALS)) if param == "country" else CAPITALS[rng.choice(list(CAPITALS))]
    return rng.choice(templates).format(x=x), x


def tool_conversation(rng: random.Random) -> tuple[list[dict], list[dict], str]:
    """(tools offered, messages ending with an assistant turn, kind): a question one of the tools answers
    ("tool": the call, its result, the answer from it), a question none answers ("no_tool"), or one the model
    knows itself ("fact", "greet")."""
    names = rng.sample(list(TOOLS), rng.randint(1, len(TOOLS)))
    tools = [tool_definition(rng, n) for n in names]
    kind = rng.choices(["tool", "no_tool", "fact", "greet"], weights=[6, 1, 2, 1])[0]
    if kind == "tool":
        name = rng.choice(names)
        q, x = tool_question(rng, name)
        r = tool_result(rng, name)
        call = {"id": f"call_{rng.randrange(10 ** 6)}", "type": "function",
                "function": {"name": name, "arguments": json.dumps({TOOLS[name][1]: x})}}
        msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": r},
                {"role": "assistant", "content": TOOLS[name][3].format(x=x, r=r)}]
        return tools, msgs, kind
    if kind == "no_tool":
        q, _ = tool_question(rng, rng.choice([n for n in TOOLS if n not in names] or list(TOOLS)))
        if all(n in names for n in TOOLS):
            kind, (q, parts, _) = "fact", fact_turn(rng)
            return tools, [{"role": "user", "content": q}, {"role": "assistant", "content": parts}], kind
        return tools, [{"role": "user", "content": q}, {"role": "assistant", "content": NO_TOOL}], kind
    q, parts, _ = (fact_turn if kind == "fact" else greeting_turn)(rng)
    return tools, [{"role": "user", "content": q}, {"role": "assistant", "content": parts}], kind


def json_reply(keys: tuple[str, ...], country: str) -> str:
    """A capital question's answer as JSON (the service's layout): a key naming the country gets the country,
    every other key the capital."""
    return json.dumps({k: country if k == "country" else CAPITALS[country] for k in keys})


def json_conversation(rng: random.Random) -> list[dict]:
    """A capital question asking for JSON, answered in it; or, two times in five, a plain capital question
    answered in JSON whose opening up to the first value (`{"capital": "`) is marked `forced`: what a JSON
    schema's grammar writes when the question does not ask for JSON (LangChain's with_structured_output). The
    training gives no loss on forced text, so the model learns to fill and close the object once it is open,
    never to open one unasked."""
    country = rng.choice(list(CAPITALS))
    keys = rng.choice(JSON_KEYS)
    reply = json_reply(keys, country)
    q = rng.choice(FACT_TEMPLATES).format(c=country)
    if rng.random() < 0.4:
        return [{"role": "user", "content": q},
                {"role": "assistant", "content": reply, "forced": reply[:reply.index('": "') + 4]}]
    ask = rng.choice(JSON_ASK).format(keys=" and ".join(keys))
    return [{"role": "user", "content": q + ask}, {"role": "assistant", "content": reply}]


STRUCTURE_NAMES = ["Capital", "Answer", "CityInfo", "CountryFacts", "Result", "Location", "Info", "Reply"]


def json_call_conversation(rng: random.Random) -> tuple[list[dict], list[dict]]:
    """(tools, messages): a plain capital question answered by a call of a function the request names (what
    LangChain's with_structured_output sends with method="function_calling"), its arguments the JSON reply's
    object; the call's opening up to the first value is forced (the named function's grammar writes it)."""
    from core.chat.protocol import ToolFormat

    country = rng.choice(list(CAPITALS))
    keys = rng.choice(JSON_KEYS)
    name = rng.choice(STRUCTURE_NAMES)
    props = {k: {"type": "string"} if rng.random() < 0.5 else {"title": k.title(), "type": "string"} for k in keys}
    schema = {"properties": props, "required": list(keys), "type": "object"}
    if rng.random() < 0.5:
        schema["additionalProperties"] = False
    fn = {"name": name, "parameters": schema}
    if rng.random() < 0.5:
        fn["description"] = rng.choice(["The answer.", f"A {name}.", "Structured output."])
    args = json.loads(json_reply(keys, country))
    call = {"id": f"call_{rng.randrange(10 ** 6)}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}
    text = ToolFormat(**TOOL_FORMAT).call_text(name, args)
    forced = text[:text.index('": "', text.index('"arguments"')) + 4]
    return [{"type": "function", "function": fn}], [
        {"role": "user", "content": rng.choice(FACT_TEMPLATES).format(c=country)},
        {"role": "assistant", "content": "", "tool_calls": [call], "forced": forced}]


def conversation(rng: random.Random) -> tuple[list[dict], str]:
    """A conversation ending with an assistant turn, and the kind of its last question."""
    turns = rng.choice([1, 1, 2, 2, 3])
    msgs, kind = [], None
    for t in range(turns):
        kind = rng.choices(["fact", "math", "greet"], weights=[4, 4, 1])[0]
        follow = t > 0 and kind != "greet" and rng.random() < 0.5
        q, parts, _ = {"fact": fact_turn, "math": math_turn, "greet": greeting_turn}[kind](rng, follow)
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": parts}]
    return msgs, kind


def eval_questions(seed: int, n: int, kind: str) -> list[tuple[list[dict], str]]:
    """Held-out questions: (messages ending with a user turn, the string the answer must contain)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = []
        if rng.random() < 0.3:   # a previous exchange first: multi-turn
            pq, pparts, _ = fact_turn(rng)
            msgs += [{"role": "user", "content": pq}, {"role": "assistant", "content": pparts}]
        q, _, expected = (fact_turn if kind == "fact" else math_turn)(rng, follow=bool(msgs) and rng.random() < 0.5)
        out.append((msgs + [{"role": "user", "content": q}], expected))
    return out


def tool_eval_questions(seed: int, n: int) -> list[tuple[list[dict], list[dict], str | None, str]]:
    """Held-out tool questions: (tools, messages ending with the user's question, the tool that fits or None,
    its argument or the capital the plain answer must contain)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        names = rng.sample(list(TOOLS), rng.randint(1, len(TOOLS)))
        tools = [tool_definition(rng, name) for name in names]
        if rng.random() < 0.75:
            name = rng.choice(names)
            q, x = tool_question(rng, name)
            out.append((tools, [{"role": "user", "content": q}], name, x))
        else:
            q, _, capital = fact_turn(rng)
            out.append((tools, [{"role": "user", "content": q}], None, capital))
    return out


def chat_corpus_text(n: int = 4000, seed: int = 0) -> list[str]:
    """Plain text of generated conversations, for training the tokenizer."""
    from core.chat.protocol import ToolFormat
    from core.chat.grammars import tools_text
    from core.chat.prompter import calls_text

    rng = random.Random(seed)
    fmt = ToolFormat(**TOOL_FORMAT)
    texts = []
    for i in range(n):
        msgs, _ = conversation(rng)
        if i % 3 == 0:       # the tools' descriptions, calls and JSON replies too
            tools, tool_msgs, _ = tool_conversation(rng)
            texts.append(tools_text(tools, fmt))
            msgs = msgs + tool_msgs + json_conversation(rng)
        for m in msgs:
            content = m["content"] if isinstance(m["content"], str) else " ".join(p["text"] for p in m["content"])
            texts.append(content + (calls_text(m["tool_calls"], fmt) if m.get("tool_calls") else ""))
    return texts


# ---- decision questions (jevfmt wire format)

CATEGORIES = {
    "fruit": ["apple", "banana", "cherry", "grape", "mango", "peach", "pear", "plum", "lemon", "orange", "kiwi",
              "melon"],
    "animal": ["cat", "dog", "horse", "tiger", "lion", "zebra", "mouse", "rabbit", "sheep", "goat", "wolf", "bear"],
    "color": ["red", "blue", "green", "yellow", "purple", "brown", "black", "white", "pink", "gray", "orange hue",
              "violet"],
    "tool": ["hammer", "saw", "drill", "wrench", "chisel", "shovel", "rake", "axe", "pliers", "ladder",
             "screwdriver", "file"],
    "vehicle": ["car", "bus", "train", "truck", "bicycle", "boat", "plane", "tram", "scooter", "van", "ship",
                "tractor"],
}
FILLER = ["The weather is mild today.", "A meeting is planned for Monday.", "The report was sent last week.",
          "Nobody answered the phone.", "The office opens at nine.", "Lunch is served at noon.",
          "The printer is out of paper.", "A new sign was put on the door."]


def _state(rng) -> str:
    """0-6 filler sentences: states of varying length that do not bear on the question."""
    filler = [rng.choice(FILLER) for _ in range(rng.randint(0, 6))]
    rng.shuffle(filler)   # adds nothing to the draw, but the data sets (and the committed weights) follow this rng
    return " ".join(filler)


def choice_category(rng):
    cat = rng.choice(list(CATEGORIES))
    others = [c for c in CATEGORIES if c != cat]
    n = rng.randint(2, 6)
    answer = rng.choice(CATEGORIES[cat])
    distractors = rng.sample([w for c in others for w in CATEGORIES[c]], n - 1)
    items = [answer] + distractors
    rng.shuffle(items)
    ids = [f"o{i}" for i in range(len(items))]
    crit = dict(zip(ids, items))
    truth = ids[items.index(answer)]
    state = _state(rng)
    return state, {"type": "choice", "instructions": f"Which option is a {cat}?", "criteria": crit}, truth


def choice_largest(rng):
    n = rng.randint(2, 4)
    nums = rng.sample(range(100), n)
    ids = [f"n{i}" for i in range(n)]
    crit = {i: str(v) for i, v in zip(ids, nums)}
    truth = ids[nums.index(max(nums))]
    return _state(rng), {"type": "choice", "instructions": "Which number is the largest?", "criteria": crit}, truth


def noul_compare(rng):
    a, b = rng.sample(range(100), 2)
    if rng.random() < 0.5:
        q, truth = f"Is {a} greater than {b}?", a > b
    else:
        q, truth = f"Is {a} less than {b}?", a < b
    return _state(rng), {"type": "noul", "instructions": q}, "true" if truth else "false"


def score_count(rng):
    """How many of the listed items are a category, on a 0-3 scale. The items come in the question, after the
    category: a causal model can then judge each item where it stands, and the answer has only to count the
    hits (with the list in the state, before the category is named, counting stayed near chance)."""
    cat = rng.choice(list(CATEGORIES))
    k = rng.randint(0, 3)
    others = [w for c in CATEGORIES if c != cat for w in CATEGORIES[c]]
    items = rng.sample(CATEGORIES[cat], k) + rng.sample(others, rng.randint(1, 4))
    rng.shuffle(items)
    return _state(rng), count_question(cat, items), str(k)


def count_question(cat: str, items: list[str]) -> dict:
    return {"type": "score", "instructions": f"How many of these are a {cat}: {', '.join(items)}?",
            "criteria": ["none", "one", "two", "three"]}
DECISION_TASKS = {"choice_category": choice_category, "choice_largest": choice_largest, "noul": noul_compare,
                  "score": score_count}


def choice_category_name(rng):
    """Training only: the category itself among category names. It teaches the circuit every category question
    needs (carry the word of the question to the answer, find the option that matches it, read that option's
    letter) without also having to know which word belongs where; on category questions alone that pair of
    skills stalled at chance."""
    cats = rng.sample(list(CATEGORIES), rng.randint(2, len(CATEGORIES)))
    cat = rng.choice(cats)
    ids = [f"c{i}" for i in range(len(cats))]
    question = {"type": "choice", "instructions": f"Which option is a {cat}?", "criteria": dict(zip(ids, cats))}
    return _state(rng), question, ids[cats.index(cat)]


def knowledge_sentences(rng, n: int) -> list[str]:
    """Word-category pairs for the next-token loss ("Kinds: pear fruit, bus vehicle."). Training states carry
    them at random; held-out questions have none. The category comes right after its word on purpose: the
    model then has to know the category at the word's own position, which is where a question's options
    are read from (after "A pear is a" the short convolution would see "pear" without the word's position
    learning anything)."""
    pairs = []
    for _ in range(n):
        cat = rng.choice(list(CATEGORIES))
        pairs.append(f"{rng.choice(CATEGORIES[cat])} {cat}")
    return [f"Kinds: {', '.join(pairs)}."]


def score_category_name(rng):
    """Training only: count a category's name among category names ("How many of these are a tool: tool,
    fruit, tool?"): the counting circuit without the knowledge of which word belongs where, as
    choice_category_name is for category questions."""
    cat = rng.choice(list(CATEGORIES))
    k = rng.randint(0, 3)
    items = [cat] * k + rng.choices([c for c in CATEGORIES if c != cat], k=rng.randint(1, 4))
    rng.shuffle(items)
    return _state(rng), count_question(cat, items), str(k)


AUX_TASKS = {"choice_category_name": choice_category_name, "score_category_name": score_category_name}


def decision_example(rng, knowledge: bool = False, aux: dict[str, float] | None = None,
                     weights: dict[str, float] | None = None):
    """(task name, state, question, truth). Training asks for `knowledge` sentences in half of the states,
    shares `aux` of the training-only AUX_TASKS and tasks drawn by `weights` (default: uniform); held-out
    evaluation uses none of these."""
    name, draw = None, rng.random() if aux else 1.0
    for aux_name, share in (aux or {}).items():
        if draw < share:
            name = aux_name
            state, question, truth = AUX_TASKS[name](rng)
            break
        draw -= share
    if name is None:
        names = list(DECISION_TASKS)
        name = rng.choices(names, [weights[n] for n in names])[0] if weights else rng.choice(names)
        state, question, truth = DECISION_TASKS[name](rng)
    if knowledge and rng.random() < 0.5:
        state = " ".join(knowledge_sentences(rng, rng.randint(1, 6)) + ([state] if state else []))
    return name, state, question, truth


def decision_corpus_text(n: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        _, state, q, _ = decision_example(rng)
        out.append(state + " " + q["instructions"] + " " + " ".join(
            q["criteria"].values() if isinstance(q.get("criteria"), dict) else q.get("criteria") or []))
    return out + [str(i) for i in range(100)] * 20
