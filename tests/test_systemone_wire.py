"""System One's answers on the wire: the records the scorer returns, written by the Ingress, are the bytes
FastAPI wrote for the same answers as dicts (what clients got before the typed path)."""
import random

from fastapi.encoders import jsonable_encoder
from starlette.responses import JSONResponse

from core.decision.protocol import (ChoiceAnswer, Decided, InputTokensDetails, NoulAnswer, ScoreAnswer, Usage,
                                    choice_answer)
from deployments.systemone import wire_json


def test_answers_are_written_as_fastapi_wrote_them():
    rng = random.Random(4)
    for _ in range(300):
        p = [rng.random() * 10 ** rng.randint(-12, 0) for _ in range(rng.randint(1, 5))]
        z = sum(p)
        dist = {f"opt-é{i}\u2028": v / z for i, v in enumerate(p)}
        answers = {
            "c": choice_answer(dist),
            "n": NoulAnswer(rng.random() * 1e-7),
            "s": ScoreAnswer(rng.random() * 3, max(p) / z, {"0": {"nested": [1, 2.5, None]}, "1": "low\n\"quoted\""},
                             {str(i): v for i, v in enumerate(dist.values())}),
        }
        body = Decided("startlux-decision", answers, Usage(rng.randint(0, 10 ** 6), 0,
                                                           InputTokensDetails(rng.randint(0, 100)))).wire()
        as_dicts = {"model": "startlux-decision",
                    "answers": {"c": {"type": "choice", "choice": answers["c"].choice,
                                      "confidence": answers["c"].confidence, "probabilities": dist},
                                "n": {"type": "noul", "noul": answers["n"].noul},
                                "s": {"type": "score", "score": answers["s"].score,
                                      "confidence": answers["s"].confidence, "legend": answers["s"].legend,
                                      "probabilities": answers["s"].probabilities}},
                    "usage": {"input_tokens": body["usage"]["input_tokens"], "output_tokens": 0,
                              "input_tokens_details": {"cached_tokens": body["usage"]["input_tokens_details"][
                                  "cached_tokens"]}}}
        assert wire_json(body).body == JSONResponse(jsonable_encoder(as_dicts)).body
    assert isinstance(answers["c"], ChoiceAnswer)
