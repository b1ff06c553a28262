"""Synthetic data for the demo models: chat conversations and jevfmt decision questions.

Everything is generated from a seed, so training (seed 0) and the held-out evaluation (another seed)
see different questions drawn from the same distribution; tools/demo_heldout.py holds sets from a generator
of its own (other phrasings, tools, result formats and keys), which measure the skills rather than the
templates.
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

# Arithmetic as people type it: the question is drawn from parts (a lead-in, the expression in symbols, words or
# a verb, a tail, the case) so widely that only reading the expression fits; the calculator part is always the
# expression meant, written plainly (`a*b`, "subtract 19 from 100" -> `100-19`).
WORDS = {"+": ["plus", "and"], "-": ["minus"], "*": ["times", "multiplied by", "x"], "/": ["divided by", "over"]}
SYMBOL = {"+": ["+"], "-": ["-"], "*": ["*", "x", "×"], "/": ["/", "÷"]}
VERB = {"+": ["add {a} and {b}", "add {b} to {a}", "the sum of {a} and {b}", "{a} added to {b}", "sum of {a} and {b}"],
        "-": ["subtract {b} from {a}", "{b} subtracted from {a}", "the difference of {a} and {b}",
              "{a} take away {b}", "{a} less {b}"],
        "*": ["multiply {a} by {b}", "multiply {a} with {b}", "the product of {a} and {b}", "{a} multiplied with {b}"],
        "/": ["divide {a} by {b}", "{a} split into {b} parts", "the quotient of {a} and {b}", "{a} shared by {b}"]}
LEADS = ["What is", "what is", "What's", "whats", "Compute", "compute", "Calculate", "calculate", "Work out",
         "Evaluate", "Find", "Figure out", "Please compute", "Can you calculate", "Could you work out", "Hey, what is",
         "Do the math:", "Math:", "Question:", "How much is", "What do you get for", "Give me", "Help me with",
         "I want to know", "Result of", "Answer:", "So what is", "Now compute", "", "", ""]
TAILS = ["?", ".", "", "", " ?", "!", " = ?", "=?", " =", " please", ", please?", " for me?", " exactly?",
         " thanks", " right now?"]
VERB_LEADS = ["", "", "Please ", "Can you ", "Could you ", "Now ", "OK, ", "Quickly ", "Help me ", "I need you to ",
              "What is ", "What do I get if I ", "Try to ", "Go ahead and "]
FOLLOW_LEADS = ["And", "Now", "What about", "and", "Then", "Next:", "Also"]


def _number(rng: random.Random) -> int:
    return rng.randint(0, 10 ** rng.randint(1, 4) - 1)


def _operands(rng: random.Random, op: str) -> tuple[int, int]:
    """Integers up to four digits (a product's second up to three); a division comes out whole, or in halves
    and quarters (what the calculator writes in a few digits)."""
    if op == "/":
        b = rng.choice([2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 16, 20, 24, 25, 32, 40, 50, 64, 100])
        a = rng.randint(0, 9999 // b - 1) * b
        if b % 4 == 0 and rng.random() < 0.3:
            a += rng.choice([b // 2, b // 4])
        return a, b
    a, b = _number(rng), (rng.randint(0, 999) if op == "*" else _number(rng))
    if op == "-" and rng.random() < 0.6:
        a, b = max(a, b), min(a, b)
    return a, b


def _spaced(rng: random.Random, parts: list[str]) -> str:
    sep = rng.choice([" ", " ", ""])
    return sep.join(parts)


def math_expression(rng: random.Random) -> tuple[str, str]:
    """(the expression as a person types it, the expression meant in the calculator's syntax)."""
    form = rng.random()
    if form < 0.2:                                  # a chain of two operators, in symbols (Python's precedence)
        ops = [rng.choice("+-*"), rng.choice("+-*")]
        a, b, c = _number(rng), rng.randint(0, 999), rng.randint(0, 999)
        shown = _spaced(rng, [str(a), rng.choice(SYMBOL[ops[0]]), str(b), rng.choice(SYMBOL[ops[1]]), str(c)])
        return shown, f"{a}{ops[0]}{b}{ops[1]}{c}"
    op = rng.choice("+-*/")
    a, b = _operands(rng, op)
    if form < 0.55:                                 # symbols, with or without spaces
        return _spaced(rng, [str(a), rng.choice(SYMBOL[op]), str(b)]), f"{a}{op}{b}"
    if form < 0.8:                                  # words
        return f"{a} {rng.choice(WORDS[op])} {b}", f"{a}{op}{b}"
    return rng.choice(VERB[op]).format(a=a, b=b), f"{a}{op}{b}"     # a verb or a phrase


def math_question(rng: random.Random, follow: bool = False) -> tuple[str, str]:
    """(a question, the calculator's expression)."""
    shown, expr = math_expression(rng)
    if follow:
        q = f"{rng.choice(FOLLOW_LEADS)} {shown}{rng.choice(['?', '.', ''])}"
    elif shown[0].isdigit() or rng.random() < 0.5:
        lead = rng.choice(LEADS)
        q = f"{lead} {shown}".strip() + rng.choice(TAILS)
    else:
        q = rng.choice(VERB_LEADS) + shown + rng.choice(["?", ".", "", "!"])
    r = rng.random()
    if r < 0.1:
        q = q.lower()
    elif r < 0.15:
        q = q.upper()
    return q, expr


def fact_turn(rng, follow=False):
    country = rng.choice(list(CAPITALS))
    q = rng.choice(FOLLOW_FACT if follow else FACT_TEMPLATES).format(c=country)
    return q, [{"type": "text", "text": f"The capital of {country} is {CAPITALS[country]}."}], CAPITALS[country]


def math_turn(rng, follow=False):
    from core.chat.calculator import format_result, use_calculator

    q, expr = math_question(rng, follow)
    value = format_result(use_calculator(expr))
    parts = [{"type": "python", "text": expr}, {"type": "python_output", "text": value},
             {"type": "text", "text": f"The answer is {value}."}]
    return q, parts, value


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
    """A result of one of the named tools, in the forms such tools write it; a fifth of them anything at all
    (the answer copies a result, whatever it is)."""
    if rng.random() < 0.2:
        return any_result(rng)
    if name == "get_weather":
        return rng.choice([f"{rng.choice(WEATHER)}, {rng.randint(-10, 35)} C", f"{word(rng)}, {rng.randint(-10, 35)} C",
                           f"{rng.choice(WEATHER)} and {rng.randint(-10, 35)} degrees", rng.choice(WEATHER)])
    if name == "get_population":
        return population_text(rng)
    return rng.choice([f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}",
                       f"{rng.randint(1, 12)}:{rng.randint(0, 59):02d} {rng.choice(['am', 'pm', 'AM', 'PM'])}"])


# ---- tools of any name, and results of any form: what the answer copies is whatever the tool wrote
SYLLABLES = ("ka ri to mo lu ve sa ne di po ba fe gu ho ji zu ra te mi no la se ko pa vi ru ta be do fi ga "
             "an el or is um en ar ol ix").split()
NOUNS = ["price", "stock", "hours", "distance", "balance", "status", "menu", "flight", "rate", "forecast", "address",
         "owner", "size", "rating", "capacity", "speed", "recipe", "schedule", "order", "ticket", "package", "account",
         "height", "review", "news", "depth", "weight", "manager", "platform", "gate", "season", "version"]
VERBS = ["get", "lookup", "find", "fetch", "check", "search", "query", "read", "show", "compute", "convert"]
PARAMS = ["query", "name", "item", "place", "symbol", "title", "word", "id", "city", "code", "topic", "amount",
          "destination", "date", "user", "product", "term", "location", "station", "team"]
ASKS = ["What is the {noun} of {x}?", "Can you check the {noun} for {x}?", "Look up the {noun} of {x}.",
        "I need the {noun} for {x}.", "Find the {noun} of {x}, please.", "{x}: what is its {noun}?",
        "Tell me the {noun} of {x}.", "What's the {noun} for {x}?", "Get me the {noun} of {x}.",
        "How about the {noun} of {x}?", "Do you know the {noun} of {x}?"]
ANSWERS = ["The {noun} of {x} is {r}.", "The {noun} is {r}.", "It is {r}.", "Here is what I found: {r}.",
           "{r}.", "The result is {r}.", "According to the tool, {r}.", "The {noun} for {x}: {r}."]
UNITS = ["km", "m", "cm", "kg", "g", "L", "ml", "miles", "metres", "feet", "C", "F", "%", "people", "items", "hours",
         "minutes", "seconds", "km/h", "points", "pages", "votes", "tons", "steps"]


# Letter pieces of the chat tokenizer's own vocabulary (use_vocabulary fills it once the tokenizer exists).
# Syllable words tokenize into the few dozen syllable tokens, so copying them teaches copying those tokens
# only; a real word the model never saw ("orchid", "granite") comes apart into other pieces, whose copies
# came out garbled. Words of any pieces train the copy for the whole vocabulary.
PIECES: list[str] = []
LETTERS = "abcdefghijklmnopqrstuvwxyz"
RESERVED: set[str] = set()
# Shares before use_vocabulary (False: phase 1, the tokenizer's text) and after it (True: the later phases): of
# any_json_conversation's keys drawn from KEY_WORDS (later fewer: a key is to be copied from the request, not
# recalled), and of json_conversation's requests that name keys of any kind (later more).
KNOWN_KEYS = {False: 0.7, True: 0.25}
ANY_JSON = {False: 0.5, True: 0.75}


def use_vocabulary(tok) -> None:
    """Build made-up words from `tok`'s letter pieces too (half of them from here on), never one of a word
    the held-out sets use (tools/demo_heldout.py: their results' words, names and JSON keys)."""
    from tools import demo_heldout as H

    pieces = set()
    for i in range(tok.vocab_size):
        text = tok.token_bytes(i).decode("utf-8", errors="ignore").strip().lower()
        if len(text) >= 2 and text.isascii() and text.isalpha():
            pieces.add(text)
    PIECES[:] = sorted(pieces)
    RESERVED.clear()
    RESERVED.update(w.lower() for w in H.WORDS_POOL + H.FIRST + H.LAST)
    RESERVED.update(part for keys in H.KEY_SETS for k in keys for part in [k, *k.split("_")])


def word(rng: random.Random) -> str:
    """A made-up word: nothing the model can know, only copy. Two or three syllables, or (after
    use_vocabulary, half of the time) one to three pieces of the tokenizer's vocabulary or single letters."""
    if PIECES and rng.random() < 0.5:
        while True:
            # a real word comes apart into single letters too ("town": t, ow, n): a quarter of the pieces
            w = "".join(rng.choice(LETTERS) if rng.random() < 0.25 else rng.choice(PIECES)
                        for _ in range(rng.choice([1, 2, 2, 3, 3])))
            if w not in RESERVED and 2 <= len(w) <= 14:
                break
    else:
        while True:
            w = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))
            if w not in RESERVED:       # (RESERVED is empty before use_vocabulary: phase 1 draws no words)
                break
    return w.capitalize() if rng.random() < 0.2 else w


def any_result(rng: random.Random) -> str:
    """A tool result of any form: words, a number with a unit, a time, a price, a name, a short list, a code."""
    kind = rng.randrange(9)
    number = lambda: rng.choice([str(rng.randint(0, 99999)), f"{rng.randint(0, 9999)}.{rng.randint(0, 99)}",   # noqa: E731
                                 f"{rng.randint(1, 999):,}", f"{rng.randint(1, 99)},{rng.randint(0, 999):03d}"])
    if kind == 0:
        return " ".join(word(rng) for _ in range(rng.randint(1, 4)))
    if kind == 1:
        return f"{rng.choice(['', '', 'about ', 'around ', 'over ', 'under '])}{number()} {rng.choice(UNITS)}"
    if kind == 2:
        return rng.choice([f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}",
                           f"{rng.randint(1, 12)} {rng.choice(['am', 'pm'])}",
                           f"{rng.choice(['open until', 'closes at', 'from'])} {rng.randint(6, 23)}:{rng.choice(['00', '15', '30', '45'])}",
                           f"{rng.randint(1, 12)}:{rng.randint(0, 59):02d} {rng.choice(['AM', 'PM'])}"])
    if kind == 3:
        amount = f"{rng.randint(0, 9999)}.{rng.randint(0, 99):02d}"
        return rng.choice([f"{amount} EUR", f"${amount}", f"{amount} USD", f"£{amount}", f"{amount} dollars",
                           f"€{amount}", f"{amount} GBP"])
    if kind == 4:
        return f"{word(rng).capitalize()} {word(rng).capitalize()}"
    if kind == 5:
        return ", ".join(word(rng) for _ in range(rng.randint(2, 4)))
    if kind == 6:
        return "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ0123456789") for _ in range(rng.randint(3, 8)))
    if kind == 7:
        return f"{rng.choice(['yes', 'no', 'true', 'false', 'none', 'unknown', 'pending', 'done'])}"
    return f"{word(rng)}, {rng.randint(-20, 40)} C"


def any_tool(rng: random.Random) -> tuple[dict, str, str, str]:
    """A function tool of a made-up name and parameter -> (its definition, the parameter, the noun its question
    asks for, a question template with {x})."""
    noun = rng.choice(NOUNS)
    name = rng.choice([f"{rng.choice(VERBS)}_{noun}", f"{noun}_{rng.choice(['lookup', 'info', 'tool', 'api'])}",
                       f"{rng.choice(VERBS)}{noun.capitalize()}", f"{word(rng)}_{noun}"])
    param = rng.choice(PARAMS)
    schema = {"type": "object", "properties": {param: {"type": "string"}}, "required": [param]}
    if rng.random() < 0.3:
        schema["additionalProperties"] = False
    fn = {"name": name, "parameters": schema}
    if rng.random() < 0.7:
        fn["description"] = f"{rng.choice(['Get', 'Look up', 'Find', 'Return'])} the {noun} of a {param}."
    return {"type": "function", "function": fn}, param, noun, rng.choice(ASKS)


def any_tool_conversation(rng: random.Random) -> tuple[list[dict], list[dict], str]:
    """(tools, messages, kind): one to three made-up tools offered (sometimes beside the named ones), the
    question that fits one of them, its call with the subject from the question, its result, and the answer
    with the result as the tool wrote it."""
    made = [any_tool(rng) for _ in range(rng.randint(1, 3))]
    made = [m for i, m in enumerate(made) if m[0]["function"]["name"] not in
            {x[0]["function"]["name"] for x in made[:i]}]
    tools = [m[0] for m in made] + [tool_definition(rng, n) for n in rng.sample(list(TOOLS), rng.randint(0, 1))]
    rng.shuffle(tools)
    fn, param, noun, ask = rng.choice(made)
    x = rng.choice([word(rng), word(rng).capitalize(), f"{word(rng).capitalize()} {word(rng).capitalize()}",
                    rng.choice(list(CAPITALS)), str(rng.randint(1, 9999))])
    r = any_result(rng)
    name = fn["function"]["name"]
    call = {"id": f"call_{rng.randrange(10 ** 6)}", "type": "function",
            "function": {"name": name, "arguments": json.dumps({param: x})}}
    return tools, [{"role": "user", "content": ask.format(noun=noun, x=x)},
                   {"role": "assistant", "content": "", "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": call["id"], "content": r},
                   {"role": "assistant", "content": rng.choice(ANSWERS).format(noun=noun, x=x, r=r)}], "tool"


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
    knows itself ("fact", "greet"); two times in five, a question for a made-up tool (any_tool_conversation)."""
    if rng.random() < 0.4:
        return any_tool_conversation(rng)
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
    never to open one unasked. A share of the time instead (ANY_JSON), a request naming keys of any kind (any_json_conversation)."""
    if rng.random() < ANY_JSON[bool(PIECES)]:
        return any_json_conversation(rng)
    country = rng.choice(list(CAPITALS))
    keys = rng.choice(JSON_KEYS)
    reply = json_reply(keys, country)
    q = rng.choice(FACT_TEMPLATES).format(c=country)
    if rng.random() < 0.4:
        return [{"role": "user", "content": q},
                {"role": "assistant", "content": reply, "forced": reply[:reply.index('": "') + 4]}]
    ask = rng.choice(JSON_ASK).format(keys=" and ".join(keys))
    return [{"role": "user", "content": q + ask}, {"role": "assistant", "content": reply}]


KEY_WORDS = ["name", "value", "type", "kind", "size", "age", "owner", "label", "note", "status", "code", "id", "year",
             "level", "unit", "group", "tag", "mood", "shape", "sport", "food", "drink", "pet", "job", "hobby",
             "brand", "model", "genre", "weather", "ocean", "mountain", "lake", "street", "color", "city", "country",
             "capital", "email", "phone", "date", "time", "count", "total", "summary", "height", "weight", "owner_name",
             "start_date", "end_date", "user_id", "full_name", "description", "category", "rating", "speed"]
TOPICS = ["a dog", "a song", "a car", "a holiday", "a recipe", "the sea", "a robot", "a garden", "a city", "a game",
          "a student", "an island", "a train", "a bird", "a movie", "a shop", "a planet", "a mountain", "a river",
          "a teacher", "a fruit", "a language", "a sports team", "a book", "an animal", "a friend", "Rome", "Peru"]
KEY_ASKS = ["Give me a JSON object about {t} with the keys {k}.", "JSON for {t}, with keys {k}.",
            "Write {t} as JSON using keys {k}.", "Reply with JSON about {t}. Keys: {k}.",
            "I want a JSON object with {k} for {t}.", "Create JSON ({k}) describing {t}.",
            "Return a JSON object with the keys {k}, about {t}.", "Describe {t} in JSON, fields {k}.",
            "Produce JSON with exactly the keys {k} for {t}.", "{k}: put {t} into a JSON object with these keys.",
            "Make up {t} and answer in JSON with keys {k}.", "JSON please, for {t}, with {k}."]


def key_list(rng: random.Random, keys: list[str]) -> str:
    """Keys as a request names them: plain or quoted, with commas or "and"."""
    shown = [f'"{k}"' if rng.random() < 0.3 else k for k in keys]
    if len(shown) == 1 or rng.random() < 0.4:
        return ", ".join(shown)
    return ", ".join(shown[:-1]) + " and " + shown[-1]


def any_value(rng: random.Random, topic: str):
    return rng.choice([word(rng), word(rng).capitalize(), rng.randint(0, 9999), topic.split()[-1],
                       f"{word(rng)} {word(rng)}", rng.choice([True, False]), round(rng.uniform(0, 100), 1)])


def any_json_conversation(rng: random.Random) -> list[dict]:
    """A request naming one to four keys of any kind (of KEY_WORDS or made up) for a topic, answered by a JSON
    object with exactly those keys in that order and values of its own."""
    keys = []
    while len(keys) < rng.choice([1, 2, 2, 2, 3, 3, 4]):
        k = rng.choice(KEY_WORDS) if rng.random() < KNOWN_KEYS[bool(PIECES)] else word(rng)
        if k not in keys:
            keys.append(k)
    topic = rng.choice(TOPICS)
    q = rng.choice(KEY_ASKS).format(t=topic, k=key_list(rng, keys))
    return [{"role": "user", "content": q[0].upper() + q[1:]},
            {"role": "assistant", "content": json.dumps({k: any_value(rng, topic) for k in keys})}]


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
