"""The decision protocol: every record that crosses a boundary of the decision path, in one torch-free module.

    client --JSON--> Ingress: deployments/systemone.py checks the HTTP shape and the limits, and parses the
                     state and each question once (jevfmt.parse_request, with the model's template from its
                     DecisionModelInfo) into a `DecisionRequest`
    Ingress --DecisionRequest (msgpack)--> DecisionModel deployment (@serve.batch) --Decide--> scorer process
    Ingress <--the answer's JSON body | DecisionRefused-- DecisionModel <--Done | Crashed-- scorer process

- A `DecisionRequest` holds the state as the prompt shows it and each question parsed (`Question`: its type,
  instructions and options as shown), or, for a question that does not parse, `Invalid` with why: the scorer
  adds the questions too long for the model (only it has the tokenizer) and refuses all of them in one
  `DecisionValidationError`, naming every bad key in the request's order.
- Answers are `ChoiceAnswer | NoulAnswer | ScoreAnswer` (tagged by `type`, the wire format's field) with a
  `Usage`, in a `Decided`; the decision deployment writes it as System One's JSON body (`wire_bytes`), which
  the Ingress sends as it is. Through Serve both directions are bytes, never pickled records.
- The scorer process's messages (`ScorerStart` ... `Crashed`; `Failed` and `Stop` are core/child.py's) are
  small records the two sides match on by type.

Records are frozen msgspec Structs, as chat's (core/chat/protocol.py): both the scorer's socket and Ray's hops
pickle them.
"""
from __future__ import annotations

import json
from typing import Any, Union

import msgspec

from .config import DecisionConfig


# ---- requests
class Option(msgspec.Struct, frozen=True):
    id: str
    text: str             # as the prompt shows it
    label: Any = ""       # score levels: the level's description as the client sent it (the answer's legend)


class Question(msgspec.Struct, frozen=True, tag="question", tag_field="form"):
    """One question as parsed once from the wire: what the prompt shows of it."""

    type: str                     # "choice" | "noul" | "score"
    instructions: str             # as shown ("" shows no instruction line)
    options: tuple[Option, ...]

    def narrowed(self, ids: list[str]) -> "Question":
        """The same question over some of its options (a tournament round), in the order of `ids`."""
        by_id = {o.id: o for o in self.options}
        return Question(self.type, self.instructions, tuple(by_id[i] for i in ids))


class Invalid(msgspec.Struct, frozen=True, tag="invalid", tag_field="form"):
    """A question that did not parse: why, as the refusal names it."""

    message: str


class DecisionRequest(msgspec.Struct, frozen=True):
    state: str                                        # rendered: the text the prompt's state block shows
    questions: dict[str, Union[Question, Invalid]]    # by the client's key, in its order

    def to_bytes(self) -> bytes | "DecisionRequest":
        """What the Ingress hands the decision deployment: msgpack bytes, which Serve passes without pickling
        (cloudpickle takes 3-4x as long over these nested records as over bytes: bench/README.md). A request
        msgpack cannot hold (an integer past 64 bits in a level's description) goes as the record itself."""
        try:
            return _ENCODER.encode(self)
        except (OverflowError, TypeError):
            return self

    @staticmethod
    def of(data: "bytes | DecisionRequest") -> "DecisionRequest":
        return _REQUEST.decode(data) if isinstance(data, bytes) else data


_ENCODER = msgspec.msgpack.Encoder()
_REQUEST = msgspec.msgpack.Decoder(DecisionRequest)


# ---- answers
class ChoiceAnswer(msgspec.Struct, frozen=True, tag="choice", tag_field="type"):
    choice: str
    confidence: float
    probabilities: dict[str, float]


class NoulAnswer(msgspec.Struct, frozen=True, tag="noul", tag_field="type"):
    noul: float                   # probability that the answer is true


class ScoreAnswer(msgspec.Struct, frozen=True, tag="score", tag_field="type"):
    score: float                  # expected level
    confidence: float             # probability of the most likely level
    legend: dict[str, Any]        # level -> its description as sent
    probabilities: dict[str, float]


Answer = Union[ChoiceAnswer, NoulAnswer, ScoreAnswer]


class InputTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int = 0        # prompt tokens whose state came from the prefix cache, not computed


class Usage(msgspec.Struct, frozen=True):
    input_tokens: int             # tokens of every prompt as rendered
    output_tokens: int = 0
    input_tokens_details: InputTokensDetails = InputTokensDetails()


def choice_answer(dist: dict[str, float]) -> ChoiceAnswer:
    """A choice question's answer from its distribution over option ids: the most probable one and its mass."""
    best = max(dist, key=dist.get)
    return ChoiceAnswer(best, dist[best], dist)


# ---- the deployment's answers to the Ingress
class DecisionModelInfo(msgspec.Struct, frozen=True):
    """What the Ingress knows of the decision model it serves (DecisionModel.info, asked once)."""

    id: str
    created: int                  # the checkpoint's time (its config file's modification time)
    aliases: tuple[str, ...] = ()  # other names a request may give in `model` (the Ingress's registry routes)
    template: dict = {}           # the prompt template (jevfmt.template_from): how questions are parsed


class Decided(msgspec.Struct, frozen=True):
    """A decision request answered."""

    model: str
    answers: dict[str, Answer]    # by question key, in the request's order
    usage: Usage

    def wire(self) -> dict:
        """System One's response body, as builtins."""
        return msgspec.to_builtins(self)

    def wire_bytes(self) -> bytes:
        """System One's response body as the service sends it: the json module's compact UTF-8 (its float
        formatting is the wire format's; msgspec's differs), as FastAPI wrote the same body as a dict."""
        return json.dumps(self.wire(), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


class DecisionRefused(msgspec.Struct, frozen=True):
    """A decision request refused for its questions or state: every bad key and why (the Ingress's 400)."""

    errors: dict[str, str]

    @property
    def message(self) -> str:
        keys = ", ".join(f"{k!r}" for k in self.errors)
        return f"invalid questions ({keys}): " + "; ".join(f"{k}: {v}" for k, v in self.errors.items())


class DecisionValidationError(ValueError):
    """A request with bad questions; `errors` maps every bad question key (or "state"/"questions") to why."""

    def __init__(self, errors: dict[str, str]):
        self.errors = dict(errors)
        super().__init__("; ".join(f"{k}: {v}" for k, v in self.errors.items()))

    def __reduce__(self):          # rebuilt from its errors (it crosses from the decision process)
        return (DecisionValidationError, (self.errors,))


def decide_wire(requests: list, parse, decide, with_usage: bool, return_exceptions: bool) -> list:
    """A scorer's wire-format entry over its typed one (StartLuxDecision.decide_batch, the synthetic scorer's):
    (state, questions) pairs -> answers (and usage) as System One's JSON objects; a bad request raises its
    DecisionValidationError, or with `return_exceptions` holds it in its slot while the others are answered.
    `parse(state, questions)` -> a DecisionRequest; `decide(requests)` -> per request (answers, Usage) or its
    DecisionValidationError."""
    parsed: list = []
    for state, questions in requests:
        try:
            parsed.append(parse(state, questions))
        except DecisionValidationError as e:
            if not return_exceptions:
                raise
            parsed.append(e)
    todo = [r for r in parsed if isinstance(r, DecisionRequest)]
    done = iter(decide(todo) if todo else [])
    out = []
    for r in parsed:
        res = next(done) if isinstance(r, DecisionRequest) else r
        if isinstance(res, DecisionValidationError):
            if not return_exceptions:
                raise res
            out.append(res)
            continue
        answers, usage = msgspec.to_builtins(res)
        out.append((answers, usage) if with_usage else answers)
    return out


# ---- the scorer process (core/decision/process.py)
class ScorerStart(msgspec.Struct, frozen=True):
    checkpoint: str
    config: DecisionConfig
    device: str | None = None
    torch_threads: int | None = None
    return_memory_s: float = 30.0   # free memory back to the system at most this often (memory.MemoryReturn)


class ScorerInfo(msgspec.Struct, frozen=True):
    """What the deployment and its tests read of a scorer, wherever it runs."""

    path: str
    device: str
    kernels: dict[str, str]
    max_length: int
    max_batch_tokens: int
    graphs: bool
    prefix_cache_bytes: int
    torch_threads: int | None     # None: the synthetic scorer (no torch)
    pid: int
    template: dict                # the checkpoint's prompt template


class PrefixStats(msgspec.Struct, frozen=True):
    entries: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    query_tokens: int = 0         # prefix tokens looked up
    hit_tokens: int = 0           # ... and found


class ScorerReady(msgspec.Struct, frozen=True):
    info: ScorerInfo
    prefix_stats: PrefixStats


class Decide(msgspec.Struct, frozen=True):
    call: int
    requests: list[DecisionRequest]


class Done(msgspec.Struct, frozen=True):
    call: int
    results: list                 # per request: (answers, Usage) or its DecisionValidationError
    prefix_stats: PrefixStats
    memory: dict = {}             # the memory returns so far and the heap the last left (memory.MemoryReturn.report)


class Crashed(msgspec.Struct, frozen=True):
    call: int
    message: str
