"""OpenAI response shaping: calculator calls reach the client as `parts` and go back into the prompt."""
from core.chat import ChatPrompter
import pytest
from pydantic import TypeAdapter

from core.chat.protocol import ChatModelInfo, Delta, SamplingDefaults, ShownLogprobs, ShownToken, TokenEvent
from deployments.deltas import deltas
from deployments.completion import Completion, TextCompletion
from deployments.openai_requests import ChatCompletionRequest, TextCompletionRequest, unsupported

INFO = ChatModelInfo("m", 0, sequence_len=64, max_n=4, vocab_size=100, sampling_defaults=SamplingDefaults())


def ev(text, segment="text", token=1, finish=None, closes=False, forced=False, completion=1, index=0, lp=None,
       prompt=10, cached=0):
    entry = None
    if lp is not None:
        shown = ShownToken(text, tuple(text.encode()), lp)
        entry = ShownLogprobs(shown, (shown,))
    return Delta(index, () if token is None else (token,), text, segment, closes, finish, prompt, completion, cached,
                 None if entry is None else (entry,), None if entry is None else (0,))


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
    assert resp["usage"] == {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22,
                             "prompt_tokens_details": {"cached_tokens": 0}}


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


def test_logprob_entries_ride_on_the_next_chunk_of_their_choice():
    c = Completion("m", 1, logprobs=True)
    chunks = []
    for e in [ev("Hi", lp=-0.1), ev("", token=5, lp=-0.2), ev(" there", lp=-0.3, completion=3),
              ev("", token=None, finish="stop", completion=3)]:
        chunks += c.feed(e)
    carried = [e["logprob"] for ch in chunks for e in ((ch["choices"][0]["logprobs"] or {}).get("content") or [])]
    assert carried == [-0.1, -0.2, -0.3]               # the token without text goes with the next text chunk
    resp = c.response()
    assert [e["logprob"] for e in resp["choices"][0]["logprobs"]["content"]] == [-0.1, -0.2, -0.3]


def test_text_completion_shapes_prompts_and_cached_tokens():
    c = TextCompletion("m", 2, prompts=2, logprobs=True, echo=["p0 ", "p1 "])
    for e in [ev("a", index=0, lp=-1.0, prompt=4, cached=0), ev("b", index=3, lp=-2.0, prompt=6, cached=2),
              ev("", token=None, finish="length", index=0, prompt=4), ev("", token=None, finish="stop", index=3, prompt=6,
                                                                         cached=2)]:
        c.feed(e)
    resp = c.response()
    assert resp["object"] == "text_completion" and [ch["text"] for ch in resp["choices"]] == ["p0 a", "p0 ", "p1 ",
                                                                                                "p1 b"]
    assert resp["choices"][0]["logprobs"] == {"tokens": ["a"], "token_logprobs": [-1.0],
                                              "top_logprobs": [{"a": -1.0}], "text_offset": [3]}   # after the echo
    assert resp["usage"]["prompt_tokens"] == 10 and resp["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


@pytest.mark.parametrize("body,name", [
    ({"functions": []}, "functions"), ({"function_call": "auto"}, "function_call"), ({"audio": {}}, "audio"),
    ({"modalities": ["text"]}, "modalities"), ({"prediction": {}}, "prediction"),
    ({"web_search_options": {}}, "web_search_options"), ({"best_of": 3}, "best_of"),
])
def test_unsupported_parameters_are_named(body, name):
    assert unsupported(body)[0] == name
    assert unsupported({"response_format": {"type": "json_object"}, "tools": [], "tool_choice": "none", "user": "u",
                        "best_of": 1}) is None


def test_completion_prompt_forms():
    assert TextCompletionRequest.model_validate({"prompt": "hi"}).prompts() == ["hi"]
    assert TextCompletionRequest.model_validate({"prompt": [1, 2, 3]}).prompts() == [[1, 2, 3]]
    assert TextCompletionRequest.model_validate({"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    assert TextCompletionRequest.model_validate({"prompt": [[1], [2, 3]]}).prompts() == [[1], [2, 3]]
    for bad in ({"prompt": []}, {"prompt": [[]]}, {"prompt": "x", "max_tokens": 0}, {"prompt": [-1]}):
        with pytest.raises(ValueError):
            TextCompletionRequest.model_validate(bad)


def shown(token, lp, top=()):
    return ShownLogprobs(ShownToken(token, tuple(token.encode()), lp), tuple(ShownToken(t, (), v) for t, v in top))


def test_echo_with_logprobs_scores_the_prompt_first():
    """The prompt's entries (the first without a logprob) lead each choice's legacy logprobs; offsets run through
    the echoed text, then the completion; streamed, the echo chunk waits for them and carries them."""
    entries = (shown("The", None), shown(" cat", -2.0, [(" cat", -2.0), (" dog", -2.5)]), shown(" sat", -1.0))
    for streamed in (False, True):
        c = TextCompletion("m", 2, prompts=1, logprobs=True, echo=["The cat sat"])
        chunks = c.first_chunks()
        assert chunks == []
        first = Delta(0, (7,), " on", prompt_tokens=4, completion_tokens=1,
                      logprobs=(shown(" on", -0.5, [(" on", -0.5)]),), logprob_offsets=(0,), prompt_entries=entries)
        for e in [first, ev(" a", index=1, lp=-0.7), ev("", token=None, finish="length", index=0, completion=1),
                  ev("", token=None, finish="length", index=1, completion=1)]:
            chunks += c.feed(e)
        echo = [ch["choices"][0] for ch in chunks[:2]]
        assert [(x["index"], x["text"]) for x in echo] == [(0, "The cat sat"), (1, "The cat sat")]
        assert echo[0]["logprobs"]["token_logprobs"] == [None, -2.0, -1.0]
        assert echo[0]["logprobs"]["top_logprobs"] == [None, {" cat": -2.0, " dog": -2.5}, {}]
        assert echo[0]["logprobs"]["text_offset"] == [0, 3, 7]
        choice = c.response()["choices"][0]
        assert choice["text"] == "The cat sat on"
        assert choice["logprobs"]["tokens"] == ["The", " cat", " sat", " on"]
        assert choice["logprobs"]["token_logprobs"] == [None, -2.0, -1.0, -0.5]
        assert choice["logprobs"]["text_offset"] == [0, 3, 7, 11]
    scored = TextCompletionRequest.model_validate({"prompt": [1, 2], "echo": True, "logprobs": 1, "max_tokens": 0})
    assert scored.to_params(INFO).prompt_logprobs == 1 and scored.to_params(INFO).max_tokens == 0
    assert TextCompletionRequest.model_validate({"prompt": "x", "logprobs": 2}).to_params(
        INFO).prompt_logprobs is None                              # no echo: the prompt is not scored


def engine_events(tokenizer):
    """A made-up run of engine events over two choices: text with a token that shows nothing yet, a calculator
    call and its forced result, logprobs, a finish carrying held text."""
    t = tokenizer.encode_special
    ids = tokenizer.encode(" so")

    def e(index, token, text, segment="text", closes=False, finish=None, forced=False, completion=1):
        lp = None if forced or token is None else -0.1 * (completion + 1)
        return TokenEvent("r", index, token, text, segment, forced, closes, finish, 7, completion, 2, lp,
                          None if lp is None else [(token, lp), (3, -4.0)])
    return [e(0, 65, "It", completion=1), e(1, 66, "B", completion=1), e(0, 67, "", completion=2),
            e(0, 68, " is é", completion=3), e(0, t("<|python_start|>"), "", completion=4),
            e(1, 69, "ye", completion=2), e(0, 70, "6*7", "python", completion=5),
            e(0, t("<|python_end|>"), "", "python", closes=True, completion=6),
            e(0, t("<|output_start|>"), "", forced=True, completion=7),
            e(0, 71, "42", "python_output", forced=True, completion=8),
            e(0, t("<|output_end|>"), "", "python_output", closes=True, forced=True, completion=9),
            e(0, ids[0], " so", completion=10), e(1, None, "s!", finish="stop", completion=2),
            e(0, None, "", finish="length", completion=10)]


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_merged_deltas_give_what_one_record_per_event_gives(tokenizer, kind):
    """However a stream's events are grouped into messages (one per event, or all in one), the client gets the
    same content, parts, logprobs (with their text offsets) and usage; merged, it gets fewer chunks."""
    events = engine_events(tokenizer)

    def shaped(messages):
        c = (Completion("m", 2, logprobs=True) if kind == "chat"
             else TextCompletion("m", 2, logprobs=True, echo=["Q: "]))
        chunks = [ch for m in messages for d in deltas(tokenizer, m) for ch in c.feed(d)]
        body = c.response()
        body.pop("id"), body.pop("created")
        return body, chunks

    apart, chunks_apart = shaped([[ev] for ev in events])
    together, chunks_together = shaped([events])
    assert apart == together
    assert len(chunks_together) < len(chunks_apart)
    key = "delta" if kind == "chat" else None
    content = lambda chunks, i: "".join((ch["choices"][0][key].get("content") or "") if key else  # noqa: E731
                                        ch["choices"][0]["text"] for ch in chunks if ch["choices"][0]["index"] == i)
    for i in (0, 1):
        assert content(chunks_apart, i) == content(chunks_together, i)
    if kind == "text":
        offsets = together["choices"][0]["logprobs"]["text_offset"]
        assert offsets == [3, 5, 5, 10, 10, 10, 10]  # after "Q: ", per token; a calculator call adds none


def conforms(shape, answer) -> None:
    """`answer` is exactly `shape` as published (no key it leaves out, every key it requires, the types)."""
    TypeAdapter(shape).validate_python(answer, strict=True)


def test_every_answer_has_its_published_shape():
    """Chunks and whole answers of chat (text, calculator parts, logprobs, tool calls), text completions (echo,
    legacy logprobs) and the Responses API validate against the TypedDicts the published schema is made of; a
    key a handler adds that the schema lacks fails here."""
    from core.chat.grammars import tool_plan
    from deployments import openai_shapes as S
    from deployments.responses_api import ResponsesRequest
    from deployments.responses_stream import ResponseBuilder

    calc = [ev("It is ", lp=-0.5), ev("6*", "python"), ev("7", "python"), ev("", "python", closes=True),
            ev("42", "python_output", forced=True), ev("", "python_output", closes=True), ev(" so 42.", lp=-0.1),
            ev("", token=None, finish="stop", completion=12)]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = [ev('[{"name": "f", "arguments": {"a": '), ev('1}}]'), ev("", token=None, finish="stop")]
    for c, events in ((Completion("m", 1, logprobs=True), calc),
                      (Completion("m", 1, tools=tool_plan(tools, "required", None)), call)):
        chunks = c.first_chunks() + [ch for e in events for ch in c.feed(e)] + c.last_chunks(True)
        assert len(chunks) > 3 and "usage" in chunks[-1]
        for ch in chunks:
            conforms(S.ChatCompletionChunk, ch)
        conforms(S.ChatCompletionResponse, c.response())
    assert c.response()["choices"][0]["message"]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}

    text = TextCompletion("m", 1, logprobs=True, echo=["Q: "])
    chunks = text.first_chunks() + [ch for e in calc for ch in text.feed(e)] + text.last_chunks(True)
    for ch in chunks:
        conforms(S.TextCompletionChunk, ch)
    conforms(S.TextCompletionResponse, text.response())

    req = ResponsesRequest.model_validate({"input": "hi", "tools": [{"type": "function", "name": "f"}],
                                           "tool_choice": "required"})
    builder = ResponseBuilder("m", req, None, req.to_chat().to_params(INFO))
    for e in [ev("Hello"), ev("", token=None, finish="length")]:
        builder.feed(e)
    conforms(S.ResponseObject, builder.response())
    assert builder.response()["status"] == "incomplete" and builder.response()["usage"]["input_tokens"] == 10
