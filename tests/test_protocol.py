"""The chat protocol (core/chat/protocol.py) and the engine's output side (core/chat/outputs.py), without a model.

- Every record that crosses the engine socket or a Serve hop survives pickling, through a real socket pair.
- The Ingress process imports neither torch nor transformers (checked in a fresh interpreter).
- The sampling limits live in one place: the HTTP schema quotes them and SamplingParams enforces them.
- The output side, driven by a tokenizer alone: text, the calculator's state machine, stop strings held back,
  lengths; and a replay (feed the tokens, drop the events) leaves it where the uninterrupted run was.
"""
import pickle
import random
import socket
import subprocess
import sys
from multiprocessing.connection import Connection

import pytest

from core.chat import protocol as P
from core.chat.outputs import OutputProcessor, RequestView
from core.child import Failed, Stop
from deployments.openai_requests import ChatCompletionRequest, TextCompletionRequest

EVENT = P.TokenEvent("r1", 0, 17, "hi", "text", False, False, None, 12, 3, 4, -0.5, [(17, -0.5), (3, -1.5)])
PARAMS = P.SamplingParams(max_tokens=9, temperature=0.7, top_k=5, top_p=0.9, seed=3, n=2, stop=("x",),
                          presence_penalty=0.5, logit_bias={3: 1.5}, logprobs=2)
MESSAGES = [
    P.EngineStart("/ckpt", "cpu", P.EngineConfig(max_rows=3, cpu_policy="idle"), (1, 2, 3)),
    P.Add("r1", [1, 2, 3], PARAMS, (4, 5)), P.Abort("r1"), Stop(),
    P.EngineReady("cpu", 123, 2, "idle"), Failed("Traceback ..."),
    P.Stats(P.EngineStats(1, 2, 3, 4, 5, 6, 7, 8, 9, 10)),
    P.GenerateRequest(PARAMS, messages=({"role": "user", "content": "hi"},), resume=(7, 8)),
    P.GenerateRequest(PARAMS, prompts=("text", (1, 2, 3))), P.StreamError("full", "overloaded_error", "n", "c"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_survives_the_socket(msg):
    a, b = socket.socketpair()
    left, right = Connection(a.detach()), Connection(b.detach())
    try:
        left.send(msg)
        got = right.recv()
    finally:
        left.close()
        right.close()
    assert got == msg and type(got) is type(msg)


def test_msgpack_records_survive_their_encoding():
    """The two msgpack paths: a step's events on the engine socket, a stream's message to the Ingress."""
    events = [EVENT, P.TokenEvent("r1", 1, None, "", finish_reason="length",
                                  prompt_logprobs=[(1, None, None), (2, -1.0, [(2, -1.0), (3, -2.5)])])]
    got = P.decode_events(P.encode_events(events))
    assert got == events and all(type(e) is P.TokenEvent for e in got)
    message = [P.Delta(2, (17, 18), "hi!", "text", False, "stop", 12, 9, 4, (P.ShownLogprobs(P.ShownToken("hi", (104, 105), -0.5), (P.ShownToken("hi", (104, 105), -0.5),)),) * 2, None),
               P.Delta(0, (5,), "1+1", "python", True), P.StreamError("full", "overloaded_error", "n", "c")]
    assert P.decode_message(P.encode_message(message)) == message
    with pytest.raises(Exception):
        P.decode_message(P.encode_events(events))        # records of one path are not read as the other's


def test_errors_keep_their_fields_and_rejections_their_error():
    for err in (P.SamplingError("bad top_p", "top_p"), P.EngineFull("9 waiting"), P.EngineError("empty")):
        got = pickle.loads(pickle.dumps(P.Rejected("r", err)))
        assert type(got.error) is type(err) and str(got.error) == str(err)
        assert getattr(got.error, "param", None) == getattr(err, "param", None)


def test_records_are_frozen():
    with pytest.raises(AttributeError):
        PARAMS.temperature = 2.0
    assert P.SamplingParams(stop=["a", "b"]).stop == ("a", "b")     # lists become tuples: nothing shared mutably


def test_the_ingress_imports_neither_torch_nor_transformers():
    code = ("import sys, deployments.ingress, deployments.routing, deployments.settings; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("field,bad", [("temperature", P.MAX_TEMPERATURE + 0.1), ("top_p", 0.0),
                                       ("presence_penalty", -P.MAX_PENALTY - 1),
                                       ("repetition_penalty", P.MIN_REPETITION_PENALTY / 2),
                                       ("logprobs", P.MAX_TOP_LOGPROBS + 1), ("max_tokens", 0), ("n", 0)])
def test_sampling_limits_are_enforced_by_the_record_and_name_their_field(field, bad):
    with pytest.raises(P.SamplingError) as e:
        P.SamplingParams(**{field: bad})
    assert e.value.param == ("top_logprobs" if field == "logprobs" else field)


def test_the_http_schema_quotes_the_protocols_limits():
    props = ChatCompletionRequest.model_json_schema()["properties"]
    bound = lambda name, key: next(o[key] for o in [props[name], *props[name].get("anyOf", [])] if key in o)  # noqa: E731
    assert bound("temperature", "maximum") == P.MAX_TEMPERATURE
    assert bound("repetition_penalty", "minimum") == P.MIN_REPETITION_PENALTY
    assert bound("repetition_penalty", "maximum") == P.MAX_REPETITION_PENALTY
    assert bound("presence_penalty", "maximum") == P.MAX_PENALTY
    assert bound("top_logprobs", "maximum") == P.MAX_TOP_LOGPROBS


def test_to_params_fills_the_checkpoints_defaults_and_keeps_what_is_sent():
    defaults = P.SamplingDefaults(temperature=0.3, top_k=7, top_p=0.8, max_tokens=40)
    info = P.ChatModelInfo("m", 0, sequence_len=64, max_n=4, vocab_size=100, sampling_defaults=defaults)
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "top_p": 0.5,
                                                "logprobs": True, "top_logprobs": 2, "stop": "z", "seed": 4})
    assert req.to_params(info) == P.SamplingParams(max_tokens=40, temperature=0.3, top_k=7, top_p=0.5, seed=4,
                                                       stop=("z",), logprobs=2)
    text = TextCompletionRequest.model_validate({"prompt": [1, 2], "temperature": 0, "logit_bias": {"5": 2}})
    assert text.to_params(info) == P.SamplingParams(max_tokens=16, temperature=0.0, top_k=7, top_p=0.8,
                                                        logit_bias={5: 2.0})


# ---- the output side, with a tokenizer and no model
@pytest.fixture(scope="module")
def out(tokenizer):
    return OutputProcessor(tokenizer, sequence_len=256)


def view(params=None, max_new=64):
    return RequestView("r", params or P.SamplingParams(), max_new, prompt_tokens=5, cached_tokens=2)


def feed(out, req, s, tokens, start=10):
    events = []
    for i, tok in enumerate(tokens):
        forced = bool(s.forced) and s.forced[0] == tok
        if forced:
            s.forced.popleft()
        events += out.accept(req, s, tok, forced, start + i)
        if s.finish_reason:
            break
    return events


def test_text_events_spell_the_decoded_text(out, tokenizer):
    ids = tokenizer.encode("the cat sat on the mat, héllo 日本語!")
    s = out.new_sample(0)
    events = feed(out, view(), s, ids + [tokenizer.encode_special("<|assistant_end|>")])
    assert "".join(ev.text for ev in events) == tokenizer.decode(ids)
    assert [ev.completion_tokens for ev in events if ev.token is not None] == list(range(1, len(ids) + 1))
    assert events[-1].finish_reason == "stop" and events[-1].token is None
    assert all(ev.prompt_tokens == 5 and ev.cached_tokens == 2 for ev in events)


def test_the_calculator_queues_its_result_as_forced_tokens(out, tokenizer):
    sp = tokenizer.encode_special
    s = out.new_sample(0)
    call = [sp("<|python_start|>"), *tokenizer.encode("12*3"), sp("<|python_end|>")]
    events = feed(out, view(), s, tokenizer.encode("so") + call)
    assert list(s.forced) == [sp("<|output_start|>"), *tokenizer.encode("36"), sp("<|output_end|>")]
    python = [ev for ev in events if ev.segment == "python"]
    assert "".join(ev.text for ev in python) == "12*3" and python[-1].closes
    events = feed(out, view(), s, list(s.forced) + tokenizer.encode(" ok"))
    result = [ev for ev in events if ev.segment == "python_output"]
    assert all(ev.forced for ev in result) and "".join(ev.text for ev in result) == "36" and result[-1].closes
    assert "".join(ev.text for ev in events if ev.segment == "text") == " ok" and not s.forced


def test_stop_strings_are_held_back_and_cut(out, tokenizer):
    ids = tokenizer.encode("the cat sat on the mat and the dog")
    s = out.new_sample(0)
    events = feed(out, view(P.SamplingParams(stop=("on the m",))), s, ids)
    text = "".join(ev.text for ev in events)
    assert text == "the cat sat " and events[-1].finish_reason == "stop"
    # a tail that only might begin the stop string is released at the end
    s = out.new_sample(0)
    events = feed(out, view(P.SamplingParams(stop=("cat dog",)), max_new=len(tokenizer.encode("the cat"))), s,
                  tokenizer.encode("the cat"))
    assert "".join(ev.text for ev in events) == "the cat" and events[-1].finish_reason == "length"


def test_length_and_the_context_end_a_sample(out, tokenizer):
    ids = tokenizer.encode("the cat sat on the mat")
    s = out.new_sample(0)
    assert feed(out, view(max_new=3), s, ids)[-1].finish_reason == "length" and len(s.generated) == 3
    s = out.new_sample(0)
    events = feed(out, view(), s, ids, start=255)          # its row then holds sequence_len - 1 tokens
    assert events[-1].finish_reason == "length" and len(s.generated) == 1


@pytest.mark.parametrize("seed", range(6))
def test_a_replay_leaves_the_output_where_the_run_was(out, tokenizer, seed):
    """A random run (text, calculator calls with their forced results, stop strings): cut it anywhere, replay the
    first part, and the rest produces exactly the events the uninterrupted run produced."""
    sp = tokenizer.encode_special
    rng = random.Random(seed)
    tokens = []
    while len(tokens) < 60:
        if rng.random() < 0.3:
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            tokens += [sp("<|python_start|>"), *tokenizer.encode(f"{a}+{b}"), sp("<|python_end|>"),
                       sp("<|output_start|>"), *tokenizer.encode(str(a + b)), sp("<|output_end|>")]
        else:
            tokens += tokenizer.encode(" " + rng.choice(["cat", "dog", "héllo", "the mat", "日本語", "on"]))
    req = view(P.SamplingParams(stop=("dog on", "xyz")), max_new=len(tokens))
    whole = feed(out, req, out.new_sample(0), tokens)
    token_events = [i for i, ev in enumerate(whole) if ev.token is not None]
    assert any(ev.forced for ev in whole) and len(token_events) > 2
    k = rng.randrange(1, len(token_events))
    s = out.new_sample(0)
    assert out.replay(req, s, [whole[i].token for i in token_events[:k]]) is None
    rest = feed(out, req, s, tokens[k:], start=10 + k)
    assert rest == whole[token_events[k - 1] + 1:]
