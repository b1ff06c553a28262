"""`startlux serve` with a checkpoint converted from nanochat's current architecture (tests/data/nanochat/current,
written by nanochat's own save_checkpoint): chat, completions, logprobs, structured outputs and tool calls over
HTTP, and the real vocabulary (nanochat pads its to a multiple of 64) is what the service checks ids against."""
import json
import os

import httpx
import jsonschema
import pytest

from core.chat.config import ChatDefaults, write_json
from core.chat.convert import convert_nanochat
from tests.readme_service import ReadmeService

pytestmark = pytest.mark.serve
DATA = os.path.join(os.path.dirname(__file__), "data", "nanochat", "current")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
          "required": ["city", "ok"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "population", "parameters": {
    "type": "object", "properties": {"country": {"type": "string", "maxLength": 12}}, "required": ["country"]}}}


@pytest.fixture(scope="module")
def converted_service(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("converted") / "nanochat-current"
    version = convert_nanochat(DATA, str(ckpt))
    assert version.name == "smear-and-backout"
    write_json(str(ckpt / "chat.json"), ChatDefaults(tool_call={"start": "<tool_call>", "end": "</tool_call>"},
                                                     max_tokens=16).to_dict())
    # the README's two commands from a nanochat checkpoint to a service: convert, then startlux serve --chat-checkpoint
    svc = ReadmeService(tmp_path_factory.mktemp("converted-service"), ("--chat-checkpoint", str(ckpt)))
    svc.start()
    try:
        yield svc.url
    finally:
        svc.stop()
        left = svc.wait_gone(90)
        assert not left, left


def post(url, path, body):
    r = httpx.post(f"{url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_converted_current_nanochat_checkpoint_serves_every_api(converted_service):
    url = converted_service
    assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]][0] == "nanochat-current"
    user = [{"role": "user", "content": "what is the capital of france"}]
    chat = post(url, "/v1/chat/completions", {"messages": user, "max_tokens": 12, "temperature": 0,
                                              "logprobs": True, "top_logprobs": 3})
    choice = chat["choices"][0]
    assert chat["usage"]["completion_tokens"] >= 1 and isinstance(choice["message"]["content"], str)
    assert all(len(e["top_logprobs"]) == 3 and e["logprob"] <= 0 for e in choice["logprobs"]["content"])
    # streamed (in the precision chat_dtype auto picks here: in bf16 a prefix-cache hit may round its way to
    # another greedy token, so the text is not compared with the first answer's)
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120,
                      json={"messages": user, "max_tokens": 12, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}) as s:
        deltas = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    streamed = "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas if d["choices"])
    finish = [d["choices"][0]["finish_reason"] for d in deltas if d["choices"] and d["choices"][0]["finish_reason"]]
    assert streamed and finish in (["stop"], ["length"]) and deltas[-1]["usage"]["completion_tokens"] >= 1
    text = post(url, "/v1/completions", {"prompt": "the cat sat", "max_tokens": 8, "temperature": 0, "logprobs": 2})
    assert len(text["choices"][0]["logprobs"]["tokens"]) == text["usage"]["completion_tokens"]
    # the service knows the real vocabulary (300), not nanochat's padded 320 rows
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 310], "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "300" in r.json()["error"]["message"]
    formatted = post(url, "/v1/chat/completions", {"messages": user, "max_tokens": 120, "temperature": 1, "seed": 3,
                                                   "response_format": {"type": "json_schema", "json_schema": {
                                                       "name": "answer", "schema": SCHEMA}}})
    assert formatted["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(formatted["choices"][0]["message"]["content"]), SCHEMA)
    for choice_mode in ("required", "auto"):
        called = post(url, "/v1/chat/completions", {"messages": user, "tools": [TOOL], "tool_choice": choice_mode,
                                                    "parallel_tool_calls": False, "max_tokens": 120,
                                                    "temperature": 1, "seed": 4})
        message = called["choices"][0]["message"]
        for call in message.get("tool_calls") or []:
            assert call["function"]["name"] == "population"
            jsonschema.validate(json.loads(call["function"]["arguments"]), TOOL["function"]["parameters"])
        if choice_mode == "required":
            assert message["tool_calls"] and called["choices"][0]["finish_reason"] == "tool_calls"
