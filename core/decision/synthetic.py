"""A decision scorer without a model, for benchmarks and tests of the serving path: `decision_scorer: synthetic`.

`SyntheticScorer` has the interface the scorer's clients use (`decide_batch` with usage and exceptions, a
prefix cache's stats, the info fields) and checks every question as the real scorer does (jevfmt's
`from_systemone`: the same refusals, naming every bad question), but loads no weights and imports no torch.
Each batch takes `synthetic_batch_s + synthetic_question_s x questions` of wall time (time.sleep: the process
idles, as a scorer process idles while a GPU computes), by default an H200's time per question for the demo
model (config.H200_QUESTION_S). Answers are uniform over each question's options (a choice answers its first
option). Usage counts a token per 4 bytes of the rendered state and question, and a state seen before (among
the last `REMEMBERED` states) counts as cached, as the prefix cache would.

What it is for: what the serving processes (HAProxy, the Ingress, the decision replica and the process
client) cost per decision, and how many decisions one replica carries, at a GPU's rate on a host without one
(bench/decision_path.py --synthetic).
"""
from __future__ import annotations

import time
from collections import OrderedDict

from . import jevfmt as J
from .config import DecisionConfig
from .types import DecisionValidationError

REMEMBERED = 4096
BYTES_PER_TOKEN = 4


def _tokens(text: str) -> int:
    return -(-len(text.encode()) // BYTES_PER_TOKEN)


class _Seen:
    """The states seen lately, as the prefix cache's stats report them."""

    def __init__(self):
        self.states: OrderedDict[str, int] = OrderedDict()
        self.query_tokens = self.hit_tokens = 0
        self.capacity_bytes = 0

    def hit(self, state: str, tokens: int) -> bool:
        self.query_tokens += tokens
        if state in self.states:
            self.states.move_to_end(state)
            self.hit_tokens += tokens
            return True
        self.states[state] = tokens
        if len(self.states) > REMEMBERED:
            self.states.popitem(last=False)
        return False

    def stats(self) -> dict:
        return {"entries": len(self.states), "bytes": 0, "capacity_bytes": 0, "query_tokens": self.query_tokens,
                "hit_tokens": self.hit_tokens}


class SyntheticScorer:
    def __init__(self, path: str, config: DecisionConfig | None = None):
        self.path, self.config = path, config or DecisionConfig(backend="synthetic")
        self.device, self.kernels = "synthetic", {}
        self.max_length, self.max_batch_tokens = self.config.max_length, self.config.max_batch_tokens
        self.prefix_cache = _Seen()

    def _one(self, state, questions) -> tuple[dict, dict, int]:
        if not isinstance(questions, dict) or not questions:
            raise DecisionValidationError({"questions": "must be a non-empty object of key -> question"})
        try:
            state_text = J.render_state(state)
        except J.FormatError as e:
            raise DecisionValidationError({"state": str(e)}) from None
        rows, errors = {}, {}
        for key, q in questions.items():
            try:
                rows[key] = J.from_systemone(None, q, None, state_text)
            except J.FormatError as e:
                errors[str(key)] = str(e)
        if errors:
            raise DecisionValidationError(errors)
        state_tokens = _tokens(state_text)
        cached = state_tokens if state_text and self.prefix_cache.hit(state_text, state_tokens) else 0
        answers, tokens = {}, 0
        for key, row in rows.items():
            tokens += state_tokens + sum(_tokens(o.text) for o in row.options) + _tokens(row.question) + 4
            answers[key] = uniform_answer(row)
        usage = {"input_tokens": tokens, "output_tokens": 0,
                 "input_tokens_details": {"cached_tokens": cached * len(rows)}}
        return answers, usage, len(rows)

    def decide_batch(self, requests: list, with_usage: bool = False, return_exceptions: bool = False) -> list:
        out, questions = [], 0
        for state, qs in requests:
            try:
                answers, usage, n = self._one(state, qs)
            except DecisionValidationError as e:
                if not return_exceptions:
                    raise
                out.append(e)
                continue
            questions += n
            out.append((answers, usage) if with_usage else answers)
        time.sleep(self.config.synthetic_batch_s + self.config.synthetic_question_s * questions)
        return out

    def decide(self, state, questions: dict) -> tuple[dict, dict]:
        return self.decide_batch([(state, questions)], with_usage=True)[0]


def uniform_answer(row: J.Row) -> dict:
    """The answer of a model that cannot tell the options apart, in the real scorer's shapes."""
    n = len(row.options)
    p = 1.0 / n
    if row.type == "noul":
        return {"type": "noul", "noul": 0.5}
    if row.type == "score":
        return {"type": "score", "score": (n - 1) / 2, "confidence": p,
                "legend": {str(i): o.label for i, o in enumerate(row.options)},
                "probabilities": {str(i): p for i in range(n)}}
    return {"type": "choice", "choice": row.options[0].id, "confidence": p,
            "probabilities": {o.id: p for o in row.options}}
