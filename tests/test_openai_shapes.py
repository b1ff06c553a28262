"""OpenAI response shaping: calculator calls reach the client as `parts` and go back into the prompt."""
from core.chat import ChatPrompter
from deployments.openai_api import ChatCompletionRequest, Completion


def ev(text, segment="text", token=1, finish=None, closes=False, forced=False, completion=1):
    return {"index": 0, "text": text, "segment": segment, "token": token, "forced": forced, "closes": closes,
            "finish_reason": finish, "prompt_tokens": 10, "completion_tokens": completion}


def test_calculator_parts_stream_and_complete():
    c = Completion("m", 1)
    chunks = []
    for e in [ev("It is "), ev("", token=7), ev("6*", "python"), ev("7", "python"), ev("", "python", closes=True),
              ev("", forced=True), ev("42", "python_output", forced=True), ev("", "python_output", closes=True),
              ev(" so 42."), ev("", token=None, finish="stop", completion=12)]:
        chunks += c.feed(e)
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    assert {"parts": [{"type": "python", "text": "6*7"}]} in deltas
    assert {"parts": [{"type": "python_output", "text": "42"}]} in deltas
    resp = c.response()
    msg = resp["choices"][0]["message"]
    assert msg["content"] == "It is  so 42."      # plain clients see only the text
    assert msg["parts"] == [{"type": "text", "text": "It is "}, {"type": "python", "text": "6*7"},
                            {"type": "python_output", "text": "42"}, {"type": "text", "text": " so 42."}]
    assert resp["usage"] == {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22}


def test_parts_go_back_into_the_prompt(tokenizer):
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "what is 6*7"},
        {"role": "assistant", "content": "It is  so 42.", "parts": [
            {"type": "text", "text": "It is "}, {"type": "python", "text": "6*7"},
            {"type": "python_output", "text": "42"}, {"type": "text", "text": " so 42."}]},
        {"role": "user", "content": "thanks"}]})
    ids = ChatPrompter(tokenizer, 512).render([m.for_prompter() for m in req.messages], 16).ids
    t = tokenizer.encode_special
    assert ids.count(t("<|python_start|>")) == 1 and ids.count(t("<|output_start|>")) == 1


def test_cut_inside_a_call_still_closes_the_part():
    c = Completion("m", 1)
    c.feed(ev("1+", "python"))
    chunks = c.feed(ev("", "python", token=None, finish="length"))
    assert chunks[0]["choices"][0]["delta"] == {"parts": [{"type": "python", "text": "1+"}]}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
