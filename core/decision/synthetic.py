"""A decision scorer without a model, for benchmarks and tests of the serving path: `decision_scorer: synthetic`.

`SyntheticScorer` has the interface the scorer's clients use (`decide_batch` with usage and exceptions, a
prefix cache's stats, the info fields) and refuses the questions the Ingress could not parse as the real scorer does (naming every bad
question), but loads no weights and imports no torch.
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
from .protocol import (ChoiceAnswer, DecisionRequest, DecisionValidationError, InputTokensDetails, Invalid, NoulAnswer,
                       Question, ScoreAnswer, Usage, decide_wire)

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
        self.template = J.template_from(None)

    def _one(self, request: DecisionRequest) -> tuple[dict, Usage, int]:
        errors = {str(k): q.message for k, q in request.questions.items() if isinstance(q, Invalid)}
        if errors:
            raise DecisionValidationError(errors)
        state_tokens = _tokens(request.state)
        cached = state_tokens if request.state and self.prefix_cache.hit(request.state, state_tokens) else 0
        answers, tokens = {}, 0
        for key, q in request.questions.items():
            tokens += state_tokens + sum(_tokens(o.text) for o in q.options) + _tokens(q.instructions) + 4
            answers[key] = uniform_answer(q)
        return answers, Usage(tokens, 0, InputTokensDetails(cached * len(answers))), len(answers)

    def decide_requests(self, requests: list[DecisionRequest]) -> list:
        out, questions = [], 0
        for request in requests:
            try:
                answers, usage, n = self._one(request)
            except DecisionValidationError as e:
                out.append(e)
                continue
            questions += n
            out.append((answers, usage))
        time.sleep(self.config.synthetic_batch_s + self.config.synthetic_question_s * questions)
        return out

    def decide_batch(self, requests: list, with_usage: bool = False, return_exceptions: bool = False) -> list:
        """The scorer's wire-format entry (tests): (state, questions) pairs -> JSON objects or refusals."""
        return decide_wire(requests, lambda state, qs: J.parse_request(state, qs, self.template), self.decide_requests,
                           with_usage, return_exceptions)


def uniform_answer(q: Question):
    """The answer of a model that cannot tell the options apart, in the real scorer's records."""
    n = len(q.options)
    p = 1.0 / n
    if q.type == "noul":
        return NoulAnswer(0.5)
    if q.type == "score":
        return ScoreAnswer((n - 1) / 2, p, {str(i): o.label for i, o in enumerate(q.options)},
                           {str(i): p for i in range(n)})
    return ChoiceAnswer(q.options[0].id, p, {o.id: p for o in q.options})
