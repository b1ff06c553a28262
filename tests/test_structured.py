"""Structured outputs: grammars from schemas and tools, constrained sampling in the engine, tool calls read back.

The reference for validity is jsonschema (an independent validator), on text sampled at temperature 1 from a
random-weights model that knows nothing of JSON: whatever it would say, the grammar lets through only valid
output. Batched runs are compared with single runs, resumed with uninterrupted ones."""
import json
import random
import re

import jsonschema
import pytest

from core.chat import ChatPrompter, LLMEngine, SamplingParams
from core.chat.weights import load_chat_model
from core.chat.protocol import ToolFormat
from core.chat.grammars import (GrammarError, ToolCallReader, json_grammar, response_format_grammar,
                                structured_outputs_grammar, tool_plan)
from core.chat.protocol import SamplingError
from tests.conftest import tiny_model

S = {"type": "string", "maxLength": 12}      # strings end: a random model rarely closes an unbounded one


def closed(schema):
    """Objects take only their listed keys (additionalProperties false where the schema says nothing): a random
    model would otherwise add keys of any value without end."""
    if isinstance(schema, dict):
        schema = {k: closed(v) for k, v in schema.items()}
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [closed(v) for v in schema]
    return schema


SCHEMAS = [closed(s) for s in [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "boolean"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    {"type": "array", "items": S, "maxItems": 3},
    {"enum": ["red", "green", "blue"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", 3, None]}}, "required": ["color"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "number", "exclusiveMinimum": -2.5, "exclusiveMaximum": 2.5},
    {"type": "object", "properties": {"x": {"type": "integer", "maximum": 9}, "y": S}, "required": ["x"],
     "additionalProperties": False},                                                     # y optional
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {"type": "string", "pattern": "^[a-z]{2,6}-[0-9]{1,3}$"},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 50}, {"type": "boolean"}, {"type": "null"}]},
    {"type": "object", "properties": {"v": {"anyOf": [S, {"type": "array", "items": {"type": "boolean"},
                                                           "maxItems": 2}]}}, "required": ["v"]},
    {"type": "boolean"},
    {"type": "null"},
    {"type": "object", "properties": {"id": {"const": "fixed"}, "n": {"type": "integer", "minimum": 1,
                                                                       "maximum": 3}}, "required": ["id", "n"]},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"enum": ["a", "b"]}, "v": {
        "type": "integer", "minimum": 0, "maximum": 9}}, "required": ["k", "v"], "additionalProperties": False},
     "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["x", "y", "z"]},
                                               "minItems": 1, "maxItems": 2}}, "required": ["tags"]},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"lat": {
        "type": "number", "minimum": -90, "maximum": 90}, "lon": {"type": "number", "minimum": -180, "maximum": 180}},
        "required": ["lat", "lon"], "additionalProperties": False}}, "required": ["p"], "additionalProperties": False},
    {"$defs": {"leaf": {"type": "integer", "minimum": 0, "maximum": 3}}, "type": "array",
     "items": {"$ref": "#/$defs/leaf"}, "maxItems": 3},
    {"type": "string", "minLength": 2, "maxLength": 5},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "why": {"type": "string", "maxLength": 8}},
     "required": ["ok"], "additionalProperties": False},
    {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 99},
    {"type": "object", "patternProperties": {"^[a-c]$": {"type": "integer", "minimum": 0, "maximum": 9}},
     "minProperties": 1, "maxProperties": 2},
    {"type": "array", "prefixItems": [{"type": "boolean"}, {"enum": [1, 2]}], "items": False, "minItems": 2},
    {"anyOf": [{"type": "string", "format": "date-time"}, {"type": "string", "format": "uuid"}]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 5}}},
               {"required": ["a"]}]},
    {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
]]


def run(engine, requests):
    """requests: {rid: (prompt, params)} all in one batch -> {rid: (text, finish_reason, tokens)}."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, rid)
    out = {rid: ["", None, []] for rid in requests}
    while engine.has_work():
        for ev in engine.step():
            o = out[ev.request_id]
            o[0] += ev.text
            if ev.token is not None:
                o[2].append(ev.token)
            if ev.finish_reason:
                o[1] = ev.finish_reason
    return {rid: tuple(o) for rid, o in out.items()}


def validate(instance, schema):
    """jsonschema's verdict, formats included (date-time, uuid: it checks them only when asked)."""
    jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER).validate(
        instance)


def test_schema_table_has_breadth():
    assert len(SCHEMAS) >= 20
    for s in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(s)
    for bad, fmt in (("2026-13-01T00:00:00Z", "date-time"), ("not-a-uuid", "uuid")):   # the reference checks them
        with pytest.raises(jsonschema.ValidationError):
            validate(bad, {"type": "string", "format": fmt})


def test_every_schema_holds_at_temperature_1_on_a_random_model(tokenizer, any_nanochat):
    """Each schema, 3 seeds, all the rows in continuous batches of 16: every output parses and validates."""
    engine = LLMEngine(any_nanochat, tokenizer, max_rows=16)
    prompt = tokenizer.encode("tell me something")
    requests = {f"{i}/{seed}": (prompt, SamplingParams(max_tokens=120, temperature=1.0, seed=seed,
                                                       grammar=json_grammar(s, "schema")))
                for i, s in enumerate(SCHEMAS) for seed in range(3)}
    for rid, (text, finish, _) in run(engine, requests).items():
        schema = SCHEMAS[int(rid.split("/")[0])]
        assert finish == "stop", (rid, schema, text)
        validate(json.loads(text), schema)


def test_the_calculator_never_runs_inside_constrained_output(tokenizer, nanochat_model):
    """The grammar allows no special token but the end of the turn: a model pushed hard towards the calculator
    (its start token biased up) still answers in JSON."""
    engine = LLMEngine(nanochat_model, tokenizer, max_rows=4)
    start = tokenizer.encode_special("<|python_start|>")
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=1, logit_bias={start: 100.0},
                            grammar=json_grammar(SCHEMAS[0], "schema"))
    free = SamplingParams(max_tokens=4, temperature=1.0, seed=1, logit_bias={start: 100.0})
    got = run(engine, {"json": (tokenizer.encode("2+2"), params), "free": (tokenizer.encode("2+2"), free)})
    jsonschema.validate(json.loads(got["json"][0]), SCHEMAS[0])
    assert start not in got["json"][2] and got["free"][2][0] == start


def test_batching_changes_nothing(tokenizer, any_nanochat):
    """A seeded constrained request gives the same tokens alone and among others (constrained and free rows),
    and a free request beside constrained ones the same as alone."""
    prompt = tokenizer.encode("the cat")
    g = json_grammar(SCHEMAS[17], "schema")
    target = SamplingParams(max_tokens=80, temperature=1.0, seed=7, grammar=g)
    free = SamplingParams(max_tokens=30, temperature=1.0, seed=3)
    alone = run(LLMEngine(any_nanochat, tokenizer, max_rows=8), {"t": (prompt, target)})["t"]
    free_alone = run(LLMEngine(any_nanochat, tokenizer, max_rows=8), {"f": (prompt, free)})["f"]
    mixed = {"t": (prompt, target), "f": (prompt, free)}
    for i in range(5):
        mixed[f"c{i}"] = (tokenizer.encode(f"other {i}"), SamplingParams(max_tokens=60, temperature=1.0, seed=i,
                                                                        grammar=json_grammar(SCHEMAS[i], "s")))
    together = run(LLMEngine(any_nanochat, tokenizer, max_rows=8), mixed)
    assert together["t"] == alone and together["f"] == free_alone


def test_n_samples_each_follow_the_grammar(tokenizer, nanochat_model):
    engine = LLMEngine(nanochat_model, tokenizer, max_rows=8)
    schema = SCHEMAS[2]
    engine.add_request(tokenizer.encode("list"), SamplingParams(max_tokens=60, temperature=1.0, n=4, seed=2,
                                                                grammar=json_grammar(schema, "s")), "r")
    texts = [""] * 4
    while engine.has_work():
        for ev in engine.step():
            texts[ev.index] += ev.text
    for t in texts:
        jsonschema.validate(json.loads(t), schema)
    assert len(set(texts)) > 1


def test_a_length_cut_says_length(tokenizer, nanochat_model):
    engine = LLMEngine(nanochat_model, tokenizer, max_rows=2)
    text, finish, tokens = run(engine, {"r": (tokenizer.encode("x"), SamplingParams(
        max_tokens=3, temperature=1.0, seed=0, grammar=json_grammar(SCHEMAS[0], "s")))})["r"]
    assert finish == "length" and len(tokens) == 3 and '{"name": "'.startswith(text)     # the layout's start


def test_a_resumed_constrained_run_is_the_rest_of_the_uninterrupted_one(tokenizer, any_nanochat):
    prompt, g = tokenizer.encode("resume me"), json_grammar(SCHEMAS[17], "s")
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=11, grammar=g)
    whole = run(LLMEngine(any_nanochat, tokenizer, max_rows=2), {"r": (prompt, params)})["r"]
    cut = len(whole[2]) // 2
    engine = LLMEngine(any_nanochat, tokenizer, max_rows=2)
    engine.add_request(prompt, params, "r", resume=whole[2][:cut])
    rest = []
    while engine.has_work():
        rest += [ev.token for ev in engine.step() if ev.token is not None]
    assert whole[2][:cut] + rest == whole[2]


def test_logprobs_of_constrained_rows_are_the_models_before_the_mask(tokenizer, nanochat_model):
    """The first token's logprob entries under a grammar equal a free greedy run's at the same place (the mask
    changes which token is drawn, not the reported distribution)."""
    prompt = tokenizer.encode("the cat")
    con = run_events(LLMEngine(nanochat_model, tokenizer, max_rows=2), prompt, SamplingParams(
        max_tokens=1, temperature=0, logprobs=3, grammar=json_grammar(SCHEMAS[0], "s")))
    free = run_events(LLMEngine(nanochat_model, tokenizer, max_rows=2), prompt,
                      SamplingParams(max_tokens=1, temperature=0, logprobs=3))
    assert con[0].top_logprobs == free[0].top_logprobs          # same top tokens and values
    assert tokenizer.decode([con[0].token]).startswith("{")     # while the drawn token follows the grammar


def run_events(engine, prompt, params):
    engine.add_request(prompt, params, "r")
    events = []
    while engine.has_work():
        events += [ev for ev in engine.step() if ev.token is not None]
    return events


def test_the_demo_model_greedy_follows_a_schema_and_a_tool():
    model, tok, _ = load_chat_model("models/demo-chat", "cpu")
    prompter = ChatPrompter(tok, model.config.sequence_len)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"enum": ["France", "Japan", "Peru"]}},
              "required": ["city", "country"], "additionalProperties": False}
    prompt = prompter.render([{"role": "user", "content": "What is the capital of France?"}], 64).ids
    engine = LLMEngine(model, tok, max_rows=2)
    text, finish, _ = run(engine, {"r": (prompt, SamplingParams(max_tokens=64, temperature=0,
                                                                grammar=json_grammar(schema, "s")))})["r"]
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), schema)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}}}]
    plan = tool_plan(tools, "required", False)          # one call: greedy, this model would repeat it
    text, finish, _ = run(engine, {"t": (prompt, SamplingParams(max_tokens=128, temperature=0,
                                                                grammar=plan.grammar))})["t"]
    calls = json.loads(text)
    assert finish == "stop" and calls[0]["name"] == "weather" and isinstance(calls[0]["arguments"]["city"], str)


# ---- grammars: what is refused, by name
@pytest.mark.parametrize("schema,keyword", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"), ({"not": {"type": "string"}}, "not"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if"), ({"type": "string", "format": "bogus"}, "bogus"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "anyOf"), ({"type": "array", "contains": {}}, "contains"),
])
def test_an_unenforceable_keyword_is_refused_by_name(schema, keyword):
    with pytest.raises(GrammarError) as e:
        response_format_grammar({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert keyword in str(e.value) and e.value.param == "response_format.json_schema.schema"
    assert isinstance(e.value, SamplingError)


def test_response_format_kinds():
    assert response_format_grammar(None) is None and response_format_grammar({"type": "text"}) is None
    assert response_format_grammar({"type": "json_object"})
    with pytest.raises(GrammarError, match="regex"):
        response_format_grammar({"type": "regex"})


def test_tool_choice_plans():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}}]
    for choice in (None, "auto"):
        with pytest.raises(GrammarError, match="required") as e:
            tool_plan(tools, choice, None)
        assert e.value.param == "tool_choice"
    assert tool_plan(tools, "none", None).grammar is None
    assert tool_plan(tools, {"type": "function", "function": {"name": "g"}}, None).mode == "named"
    with pytest.raises(GrammarError, match="'h'"):
        tool_plan(tools, {"type": "function", "function": {"name": "h"}}, None)
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}]
    with pytest.raises(GrammarError, match="uniqueItems") as e:
        tool_plan(bad, "required", None)
    assert e.value.param == "tools[0].function.parameters"


def test_required_calls_respect_parallel_tool_calls(tokenizer, nanochat_model):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}}},
             {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {
                 "y": {"enum": ["a", "b"]}}, "required": ["y"], "additionalProperties": False}}}]
    engine = LLMEngine(nanochat_model, tokenizer, max_rows=8)
    reqs = {f"{p}{seed}": (tokenizer.encode("call"), SamplingParams(
        max_tokens=120, temperature=1.0, seed=seed, grammar=tool_plan(tools, "required", p == "one").grammar))
        for p in ("one", "many") for seed in range(4)}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for rid, (text, finish, _) in run(engine, reqs).items():
        calls = json.loads(text)
        assert finish == "stop" and 1 <= len(calls) and (len(calls) == 1 or rid.startswith("many"))
        for c in calls:
            jsonschema.validate(c["arguments"], schemas[c["name"]])
        reader = ToolCallReader(tool_plan(tools, "required", None))
        cuts = sorted(random.Random(rid).sample(range(1, len(text)), min(6, len(text) - 1)))
        for a, b in zip([0] + cuts, cuts + [len(text)]):
            reader.feed(text[a:b])
        assert [(c["name"], json.loads(c["arguments"])) for c in reader.calls] == \
            [(c["name"], c["arguments"]) for c in calls]


def test_the_tool_call_reader_streams_names_first_and_arguments_in_pieces():
    tools = [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]
    text = json.dumps([{"name": "f", "arguments": {"a": "x}\"]{", "b": [1, {"c": None}]}},
                       {"name": "g", "arguments": {}}])
    for seed in range(30):
        reader = ToolCallReader(tool_plan(tools, "required", None))
        cuts = sorted(random.Random(seed).sample(range(1, len(text)), 7))
        deltas = [d for a, b in zip([0] + cuts, cuts + [len(text)]) for d in reader.feed(text[a:b])]
        assert [d[1] for d in deltas if d[1] is not None] == ["f", "g"]
        args = {}
        for index, _, frag in deltas:
            args[index] = args.get(index, "") + frag
        assert [json.loads(args[i]) for i in (0, 1)] == [{"a": "x}\"]{", "b": [1, {"c": None}]}, {}]
        assert reader.complete
    named = ToolCallReader(tool_plan(tools, {"type": "function", "function": {"name": "g"}}, None))
    assert named.feed('{"a"') == [(0, "g", '{"a"')] and not named.complete
    assert named.feed(": 1}") == [(0, None, ": 1}")] and named.complete
    cut = ToolCallReader(tool_plan(tools, "required", None))
    cut.feed(text[:-1])
    assert not cut.complete and len(cut.calls) == 2


def test_tool_calls_and_results_render_into_the_prompt(tokenizer):
    prompter = ChatPrompter(tokenizer, 512)
    messages = [{"role": "user", "content": "weather in paris"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    ids = prompter.render(messages, 16).ids
    text = tokenizer.decode(ids)
    assert '[{"name": "weather", "arguments": {"city": "paris"}}]<|assistant_end|>' in text
    assert text.endswith("<|user_start|>Result of weather: sunny<|user_end|><|assistant_start|>")


FMT = ToolFormat("<tool_call>", "</tool_call>")
FORMAT_TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {
        "y": {"enum": ["a", "b"]}}, "required": ["y"], "additionalProperties": False}}}]


def read_calls(plan, text: str, seed: int) -> ToolCallReader:
    """The reader fed `text` in random pieces, as a stream brings it."""
    reader = ToolCallReader(plan)
    cuts = sorted(random.Random(seed).sample(range(1, len(text)), min(6, len(text) - 1))) if len(text) > 1 else []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        reader.feed(text[a:b])
    reader.finish()
    return reader


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "g"}}])
@pytest.mark.parametrize("parallel", [None, False])
def test_calls_in_a_checkpoint_format_at_temperature_1(tokenizer, nanochat_model, choice, parallel):
    """A model with a tool-call format: under "auto" it writes text, or text then calls, and every call is
    `<tool_call>{"name": ..., "arguments": ...}</tool_call>` with arguments valid for its function; "required"
    and a named function are calls only. The reader takes the content and the calls back out of the stream. A
    random model decides by chance, so the 24 samples here include both kinds of reply under "auto" (the
    opening text is pushed up with a logit bias on its first token so that calls are not rare)."""
    fmt = ToolFormat("question", "answer")            # one token each in the test vocabulary
    plan = tool_plan(FORMAT_TOOLS, choice, parallel, fmt)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in FORMAT_TOOLS}
    engine = LLMEngine(nanochat_model, tokenizer, max_rows=8)
    (opening,) = tokenizer.encode(fmt.start)
    bias = {opening: 4.0, tokenizer.encode_special("<|assistant_end|>"): 4.0}
    reqs = {f"s{seed}": (tokenizer.encode("call"), SamplingParams(
        max_tokens=160, temperature=1.0, seed=seed, grammar=plan.grammar, logit_bias=bias)) for seed in range(24)}
    kinds = set()
    for rid, (text, finish, _) in run(engine, reqs).items():
        reader = read_calls(plan, text, int(rid[1:]))
        if finish == "length":
            continue
        assert finish == "stop"
        if not reader.calls:
            assert choice == "auto" and fmt.start not in text and reader.content == text
            kinds.add("text")
            continue
        kinds.add("calls")
        assert reader.complete and text == reader.content + "".join(
            fmt.call_text(c["name"], json.loads(c["arguments"])) for c in reader.calls)
        assert len(reader.calls) == 1 or parallel is None and choice != {"type": "function", "function": {"name": "g"}}
        for c in reader.calls:
            assert choice == "auto" or choice == "required" or c["name"] == "g"
            jsonschema.validate(json.loads(c["arguments"]), schemas[c["name"]])
        if choice != "auto":
            assert reader.content == ""
    assert "calls" in kinds and (choice != "auto" or "text" in kinds), kinds


def test_the_format_reader_holds_back_what_may_open_a_call():
    plan = tool_plan(FORMAT_TOOLS, "auto", None, FMT)
    reader = ToolCallReader(plan)
    assert reader.feed("I will check <tool") == [] and reader.take_content() == "I will check "
    assert reader.feed("s are fun") == [] and reader.take_content() == "<tools are fun"
    reader = ToolCallReader(plan)
    reader.feed("Let me see <tool_call>{\"name\": \"f\", \"arguments\": {\"x\": ")
    assert reader.take_content() == "Let me see " and reader.calls == [{"name": "f", "arguments": '{"x": '}]
    assert not reader.complete
    reader.feed("3}}</tool_")
    assert not reader.complete
    reader.feed("call>")
    assert reader.complete and reader.calls[0]["arguments"] == '{"x": 3}' and reader.take_content() == ""
    ending = ToolCallReader(plan)
    ending.feed("a <")
    ending.finish()              # the text ended on what looked like an opening: it was content
    assert ending.content == "a <" and not ending.complete


def test_a_checkpoint_format_in_prompts_and_plans(tokenizer):
    """History calls render in the format; "none" stays text; a bad format in chat.json is refused."""
    from core.chat.config import ChatDefaults, CheckpointError

    prompter = ChatPrompter(tokenizer, 512, tool_format=FMT)
    messages = [{"role": "user", "content": "weather in paris"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = tokenizer.decode(prompter.render(messages, 16).ids)
    assert 'Checking.<tool_call>{"name": "weather", "arguments": {"city": "paris"}}</tool_call><|assistant_end|>' in text
    assert tool_plan(FORMAT_TOOLS, "none", None, FMT).grammar is None
    assert tool_plan(FORMAT_TOOLS, None, None, FMT).mode == "auto"
    with pytest.raises(GrammarError, match="'h'"):
        tool_plan(FORMAT_TOOLS, {"type": "function", "function": {"name": "h"}}, None, FMT)
    assert ChatDefaults.from_dict({"tool_call": {"start": "<a>", "end": "</a>"}}).tool_format == ToolFormat("<a>", "</a>")
    for bad in ({"start": "<a>"}, {"start": "{", "end": "}"}, {"start": "", "end": "x"}, "<a>"):
        with pytest.raises(CheckpointError, match="tool_call"):
            ChatDefaults.from_dict({"tool_call": bad})


def test_a_prefix_cache_hit_changes_nothing(tokenizer, nanochat_model):
    """The same seeded constrained request twice on one engine: the second reuses the prompt's cached keys and
    values and samples the same tokens."""
    engine = LLMEngine(nanochat_model, tokenizer, max_rows=4)
    prompt = tokenizer.encode("the same long prompt about the cat and the dog on the mat " * 3)
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=5, grammar=json_grammar(SCHEMAS[0], "s"))
    first, second = run_events(engine, prompt, params), run_events(engine, prompt, params)
    assert [e.token for e in first] == [e.token for e in second]
    assert first[0].cached_tokens == 0 and second[0].cached_tokens > len(prompt) // 2


def test_a_grammar_the_engine_cannot_compile_is_a_sampling_error(tokenizer, nanochat_model):
    engine = LLMEngine(nanochat_model, tokenizer, max_rows=2)
    for grammar in ("not a grammar", '{"grammars": [{"lark_grammar": "start: nope"}]}'):
        with pytest.raises(SamplingError) as e:
            engine.add_request([1, 2], SamplingParams(max_tokens=4, grammar=grammar))
        assert e.value.param == "response_format"
    assert not engine.has_work()


# ---- vLLM's structured_outputs: regexes, choices and Lark grammars, each with an independent check of the text
def balanced(text: str) -> bool:
    depth = 0
    for c in text:
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth < 0 or c not in "()x":
            return False
    return depth == 0


STRUCTURED = [       # (structured_outputs, a check of the whole output written without llguidance)
    ({"regex": r"[a-z]{2,6}-[0-9]{1,3}"}, re.compile(r"[a-z]{2,6}-[0-9]{1,3}").fullmatch),
    ({"regex": r"(yes|no|maybe)!?"}, re.compile(r"(yes|no|maybe)!?").fullmatch),
    ({"regex": r"\d{4}-\d{2}-\d{2}"}, re.compile(r"\d{4}-\d{2}-\d{2}").fullmatch),
    ({"regex": r"[A-Z][a-z]{0,8}( [A-Z][a-z]{0,8}){0,2}\."}, re.compile(r"[A-Z][a-z]{0,8}( [A-Z][a-z]{0,8}){0,2}\.").fullmatch),
    ({"regex": r"0x[0-9a-f]{1,8}"}, re.compile(r"0x[0-9a-f]{1,8}").fullmatch),
    ({"choice": ["positive", "negative", "neutral"]}, {"positive", "negative", "neutral"}.__contains__),
    ({"choice": ["a.b", "a+b", "(a)", "x/y", "line\nbreak"]}, {"a.b", "a+b", "(a)", "x/y", "line\nbreak"}.__contains__),
    ({"choice": [1, 2.5, "three"]}, {"1", "2.5", "three"}.__contains__),
    ({"grammar": 'start: "(" expr ")"\nexpr: "x" | "(" expr ")" expr?'}, balanced),       # not a regular language
    ({"grammar": 'start: NUM (OP NUM){0,3}\nNUM: /[1-9][0-9]{0,2}/\nOP: " + " | " * "'},
     re.compile(r"[1-9][0-9]{0,2}(( \+ | \* )[1-9][0-9]{0,2}){0,3}").fullmatch),
    ({"grammar": 'start: "SELECT " COL ("," COL){0,2} " FROM t"\nCOL: "a" | "b" | "c"'},
     re.compile(r"SELECT [abc](,[abc]){0,2} FROM t").fullmatch),
    ({"json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
               "required": ["n"], "additionalProperties": False}},
     lambda t: set(json.loads(t)) == {"n"} and 0 <= json.loads(t)["n"] <= 9),
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
]


def test_every_structured_output_holds_at_temperature_1_on_a_random_model(tokenizer, nanochat_model):
    """Each regex, choice and grammar, 3 seeds, in one continuous batch: every output is one the independent check
    accepts (Python's re, a set, a parenthesis counter, json), ended by the grammar."""
    engine = LLMEngine(nanochat_model, tokenizer, max_rows=16)
    prompt = tokenizer.encode("say something")
    requests = {f"{i}/{seed}": (prompt, SamplingParams(max_tokens=80, temperature=1.0, seed=seed,
                                                       grammar=structured_outputs_grammar(spec)))
                for i, (spec, _) in enumerate(STRUCTURED) for seed in range(3)}
    for rid, (text, finish, _) in run(engine, requests).items():
        spec, check = STRUCTURED[int(rid.split("/")[0])]
        assert finish == "stop" and check(text), (rid, spec, text)


@pytest.mark.parametrize("spec,param,words", [
    ({"regex": "[a-z"}, "structured_outputs.regex", "unclosed"),
    ({"regex": "(?=a)b"}, "structured_outputs.regex", "look-around"),
    ({"grammar": "start: nope"}, "structured_outputs.grammar", "unknown name"),
    ({"grammar": 'root ::= "a"'}, "structured_outputs.grammar", "Lark"),
    ({"choice": []}, "structured_outputs.choice", "non-empty"),
    ({"choice": ["a", ""]}, "structured_outputs.choice", "empty"),
    ({"json": "{not json"}, "structured_outputs.json", "JSON schema"),
    ({"json": {"type": "array", "uniqueItems": True}}, "structured_outputs.json", "uniqueItems"),
    ({"regex": "a", "choice": ["b"]}, "structured_outputs", "one of"),
    ({"whitespace_pattern": r"\s*", "json_object": True}, "structured_outputs.whitespace_pattern", "not supported"),
    ({"structural_tag": "{}"}, "structured_outputs.structural_tag", "not supported"),
    ({"disable_additional_properties": True, "json_object": True}, "structured_outputs.disable_additional_properties",
     "additionalProperties"),
    ({"jsn": {}}, "structured_outputs.jsn", "not a structured-output option"),
    ("regex", "structured_outputs", "object"),
])
def test_a_structured_output_that_cannot_be_enforced_is_refused_by_name(spec, param, words):
    with pytest.raises(GrammarError) as e:
        structured_outputs_grammar(spec)
    assert e.value.param == param and words in str(e.value), str(e.value)


def test_structured_outputs_options_taken_as_they_are():
    """vLLM's options that change nothing here are taken; an empty field constrains nothing."""
    assert structured_outputs_grammar(None) is None and structured_outputs_grammar({}) is None
    assert structured_outputs_grammar({"json_object": True, "disable_any_whitespace": True, "disable_fallback": True})
    assert structured_outputs_grammar({"json": '{"type": "integer"}'}) == structured_outputs_grammar(
        {"json": {"type": "integer"}})
