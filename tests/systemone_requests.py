"""System One requests shaped like the ones real clients send (game bots, web agents, guardrails, triage)."""
from __future__ import annotations

BOARD = {"board": [["X", "O", ""], ["", "X", ""], ["O", "", ""]], "to_move": "X", "turn": 5}

REQUESTS = {
    "board_move": {
        "state": BOARD,
        "questions": {"move": {"type": "choice", "instructions": "Pick the move that wins or blocks.",
                               "criteria": {"a3": "top right", "c3": "bottom right", "b1": "middle left"}}}},
    "web_agent_json": {
        "model": "startlux-decision",
        "state": {"url": "https://shop.example/cart", "title": "Your cart",
                  "elements": [{"id": 1, "tag": "button", "text": "Checkout"}, {"id": 2, "tag": "a", "text": "Help"}]},
        "questions": {
            "next": {"type": "choice",
                     "instructions": {"goal": "buy the items in the cart", "rules": ["never pay twice", "prefer buttons"]},
                     "criteria": {"click_1": {"action": "click", "element": 1}, "click_2": {"action": "click", "element": 2},
                                  "wait": {"action": "wait"}}},
            "done": {"type": "noul", "instructions": {"check": "is the goal reached", "evidence": "page title"}}}},
    "noul_plain": {
        "state": "Hi! Click here to claim your free prize!!!",
        "questions": {"spam": {"type": "noul", "instructions": "Is this message spam?"}}},
    "mixed_ticket": {
        "state": "Ticket 4411: the app crashes when I upload a photo, every time since yesterday.",
        "questions": {
            "is_bug": {"type": "noul", "instructions": "Is this a bug report?",
                       "criteria": {"true": "something is broken", "false": "a question or a wish"}},
            "team": {"type": "choice", "instructions": "Which team takes it?",
                     "criteria": {"mobile": "the mobile app team", "web": None, "billing": "payments"}},
            "urgency": {"type": "score", "instructions": "How urgent is it?",
                        "criteria": ["can wait", "this week", "today", {"level": "now", "page": True}]}}},
    "guardrail_extra_key": {
        "state": "User: how do I reset my password?",
        "questions": {"unsafe": {"type": "noul", "instructions": "Does the message ask for something harmful?",
                                 "proposition": "the message is harmful"}}},
    "list_state_null_instructions": {
        "state": [{"id": 1, "text": "payment failed twice"}, {"id": 2, "text": "card was charged"}],
        "questions": {"topic": {"type": "choice", "instructions": None,
                                "criteria": {"billing": "money and payments", "login": "signing in"}}}},
}


def check_answers(request: dict, answers: dict) -> None:
    """Answers by name, in the request's order; probabilities that sum to 1; confidence in [0, 1]."""
    assert list(answers) == list(request["questions"])
    for name, q in request["questions"].items():
        a = answers[name]
        kind = q.get("type", "choice")
        assert a["type"] == kind
        if kind == "noul":
            assert 0.0 <= a["noul"] <= 1.0
            continue
        probs = a["probabilities"]
        assert abs(sum(probs.values()) - 1.0) < 1e-4 and all(0.0 <= p <= 1.0 for p in probs.values())
        assert 0.0 <= a["confidence"] <= 1.0 + 1e-6
        if kind == "choice":
            assert list(probs) == list(q["criteria"]) and a["choice"] in q["criteria"]
            assert a["confidence"] == max(probs.values())
        else:
            assert list(probs) == [str(i) for i in range(len(q["criteria"]))]
            assert a["legend"] == {str(i): d for i, d in enumerate(q["criteria"])}
            assert 0.0 <= a["score"] <= len(q["criteria"]) - 1
