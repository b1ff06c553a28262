"""Synthetic data for the demo models: chat conversations and jevfmt decision questions.

Everything is generated from a seed, so training (seed 0) and the held-out evaluation (another seed)
see different questions drawn from the same distribution.
"""
from __future__ import annotations

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


def chat_corpus_text(n: int = 4000, seed: int = 0) -> list[str]:
    """Plain text of generated conversations, for training the tokenizer."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        msgs, _ = conversation(rng)
        for m in msgs:
            texts.append(m["content"] if isinstance(m["content"], str) else " ".join(p["text"] for p in m["content"]))
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
