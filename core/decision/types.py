"""Typed request and answer shapes of `/v1/systemone`, shared by the scorer's callers and the HTTP layer.

The scorer itself takes and returns plain dicts in these shapes (the seed's API); these pydantic models
document them and validate at the HTTP boundary.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class Question(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["choice", "noul", "score"] = "choice"
    question: str
    criteria: dict[str, str | None] | list[str] | None = None


class DecisionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    state: Any = None
    questions: dict[str, Question] = Field(min_length=1)
    model: str | None = None          # optional; when given, it must name the decision model


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
    legend: dict[str, str]
    probabilities: dict[str, float]


Answer = Annotated[Union[ChoiceAnswer, NoulAnswer, ScoreAnswer], Field(discriminator="type")]


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int = 0


class DecisionResponse(BaseModel):
    answers: dict[str, Answer]
    usage: Usage
