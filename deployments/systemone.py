"""System One's HTTP shapes (`/v1/systemone`): the request body the Ingress validates and the answers it
publishes in its OpenAPI schema, beside chat's (openai_requests.py, openai_shapes.py).

`DecisionRequest.check(info, limits)` applies the Ingress's limits and parses the body once, with the model's
prompt template, into core.decision.protocol's `DecisionRequest`: the record the decision deployment and its
scorer take. The answers reach the Ingress as the JSON body the decision deployment wrote from protocol's
records; the pydantic answer models here only describe that body in the schema.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from core.decision import jevfmt, protocol
from core.decision.protocol import DecisionModelInfo, DecisionRefused, DecisionValidationError

from .errors import APIError, error
from .settings import IngressSettings


class Question(BaseModel):
    """One System One question. `check` parses each against its type (`jevfmt.parse_question`); one refusal
    names every bad question; unknown keys (a client's `proposition`, say) are ignored."""
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

    def check(self, info: DecisionModelInfo, limits: IngressSettings) -> protocol.DecisionRequest:
        """The Ingress's limits (an APIError naming the field), then the body parsed once with the model's
        template. A question that does not parse travels as `Invalid`: the scorer refuses it together with any
        too long for the model, in one answer naming every bad key."""
        if len(self.questions) > limits.max_questions:
            raise APIError(error(f"at most {limits.max_questions} questions per request", param="questions"))
        if self.assets:
            raise APIError(error("`assets` (images for placeholders) are not supported by this decision model; "
                                 "send the request without them", param="assets", code="unsupported_parameter"))
        questions = {k: q.model_dump(exclude_unset=True) for k, q in self.questions.items()}
        try:
            return jevfmt.parse_request(self.state, questions, info.template)
        except DecisionValidationError as e:
            raise APIError.of(DecisionRefused(e.errors)) from None


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
