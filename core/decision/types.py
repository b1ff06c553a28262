"""Typed request and answer shapes of `/v1/systemone`, shared by the scorer's callers and the HTTP layer.

The scorer itself takes and returns plain dicts in these shapes (the seed's API); these pydantic models
document them and validate at the HTTP boundary.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class Question(BaseModel):
    """One System One question. The scorer checks each question against its type (`jevfmt.from_systemone`) so
    that one error can name every bad question; unknown keys (a client's `proposition`, say) are ignored."""
    model_config = ConfigDict(extra="allow")

    type: str | None = "choice"       # "choice" | "noul" | "score"; checked with the rest of the question
    instructions: Any = None          # text, or any JSON value (shown as JSON text); null: no instruction line
    question: Any = None              # older name of `instructions`
    criteria: Any = None              # choice: {id: description}; noul: {"true": ..., "false": ...}; score: [levels]


class DecisionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None          # optional; when given, the decision model's name or one of its aliases
    state: Any = None
    questions: dict[str, Question] = Field(min_length=1)
    assets: Any = None                # images for placeholders: not supported by this scorer (a 400 says so)


class ChoiceAnswer(BaseModel):
    type: Literal["choice"] = "choice"
    choice: str
    confidence: float
    probabilities: dict[str, float]


class NoulAnswer(BaseModel):
    type: Literal["noul"] = "noul"
    noul: float                       # probability that the answer is true


class ScoreAnswer(BaseModel):
    type: Literal["score"] = "score"
    score: float                      # expected level
    confidence: float                 # probability of the most likely level
    legend: dict[str, Any]            # level -> its description as sent
    probabilities: dict[str, float]


Answer = Annotated[Union[ChoiceAnswer, NoulAnswer, ScoreAnswer], Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0            # prompt tokens whose state came from the prefix cache, not computed


class Usage(BaseModel):
    input_tokens: int                 # tokens of every prompt as rendered
    output_tokens: int = 0
    input_tokens_details: InputTokensDetails = InputTokensDetails()


class DecisionResponse(BaseModel):
    model: str                        # the id the service serves (an alias in the request is answered with it)
    answers: dict[str, Answer]
    usage: Usage


class DecisionModelInfo(BaseModel):
    """What the Ingress knows of the decision model it serves (DecisionModel.info, asked once)."""

    model_config = ConfigDict(frozen=True)

    id: str
    created: int                      # the checkpoint's time (its config file's modification time)
    aliases: tuple[str, ...] = ()     # other names a request may give in `model` (the Ingress's registry routes)


class Decided(BaseModel):
    """A decision request answered, as the decision deployment returns it to the Ingress."""

    model_config = ConfigDict(frozen=True)

    model: str
    answers: dict                     # by question name, in the request's order
    usage: dict


class DecisionRefused(BaseModel):
    """A decision request refused for its questions or state: every bad key and why (the Ingress's 400)."""

    model_config = ConfigDict(frozen=True)

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
