"""System One on the wire: the answer records, written by the decision deployment, are the bytes FastAPI wrote
for the same answers as dicts (what clients got before the typed path); a parsed request crosses Serve as
msgpack bytes and comes back equal."""
import random

from fastapi.encoders import jsonable_encoder
from starlette.responses import JSONResponse

from core.decision.protocol import (ChoiceAnswer, Decided, InputTokensDetails, NoulAnswer, ScoreAnswer, Usage,
                                    choice_answer)


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
        decided = Decided("startlux-decision", answers, Usage(rng.randint(0, 10 ** 6), 0,
                                                              InputTokensDetails(rng.randint(0, 100))))
        body = decided.wire()
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
        assert decided.wire_bytes() == JSONResponse(jsonable_encoder(as_dicts)).body
    assert isinstance(answers["c"], ChoiceAnswer)


def test_a_parsed_request_crosses_as_bytes_and_comes_back_equal():
    from core.decision import jevfmt as J
    from core.decision.protocol import DecisionRequest
    from tests.systemone_requests import REQUESTS

    for body in REQUESTS.values():
        parsed = J.parse_request(body["state"], body["questions"])
        assert isinstance(parsed.to_bytes(), bytes) and DecisionRequest.of(parsed.to_bytes()) == parsed
    bad = J.parse_request({"n": 2 ** 70}, {"s": {"type": "score", "criteria": [2 ** 70, "big"]}, "x": {"type": "vote"}})
    assert DecisionRequest.of(bad.to_bytes()) == bad            # past msgpack's integers: the record itself
    assert isinstance(bad.to_bytes(), DecisionRequest)
