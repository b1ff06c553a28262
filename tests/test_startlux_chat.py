"""`startlux chat` (cluster/cli.py) against a stand-in service that streams what the real one streams: chunks
made by the service's own Completion from Deltas, a calculator part among them, and OpenAI-shaped errors."""
import argparse
import os
import io
import socket

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from cluster.cli import chat
from core.chat.protocol import Delta
from deployments.completion import Completion, sse
from deployments.errors import error
from tests.local_server import local_server

SEEN: list[dict] = []      # every request body and its Authorization header, as the stand-in got it


def reply_for(messages: list[dict]) -> list[Delta]:
    """A reply that uses the calculator when asked for 6*7, else one that names its turn."""
    turn = sum(m["role"] == "user" for m in messages)
    if "6*7" in messages[-1]["content"]:
        return [Delta(0, (1,), "It is "), Delta(0, (2,), "6*7", "python", closes=True),
                Delta(0, (3,), "42", "python_output", closes=True), Delta(0, (4,), " 42."),
                Delta(0, (), "", finish_reason="stop")]
    return [Delta(0, (5,), f"turn {turn}"), Delta(0, (), "", finish_reason="stop")]


async def completions(request):
    body = await request.json()
    SEEN.append({"body": body, "auth": request.headers.get("authorization")})
    if body["messages"][-1]["content"] == "forbidden":
        return JSONResponse(error("missing or invalid API key", code="invalid_api_key"), status_code=401)
    if body["messages"][-1]["content"] == "fail midway":
        return StreamingResponse(iter([sse({"choices": [{"delta": {"content": "par"}}]}),
                                       sse(error("the model failed while generating", "server_error"))]),
                                 media_type="text/event-stream")
    c = Completion("chat", 1)
    chunks = c.first_chunks() + [ch for d in reply_for(body["messages"]) for ch in c.feed(d)]
    return StreamingResponse(iter([sse(ch) for ch in chunks] + ["data: [DONE]\n\n"]), media_type="text/event-stream")


@pytest.fixture(scope="module")
def url():
    with local_server(Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])) as url:
        yield url


def args(url, **kw):
    return argparse.Namespace(**{"url": url, "api_key": None, "system": None, "max_tokens": None,
                                 "temperature": None, "once": None, **kw})


def test_a_conversation_streams_and_goes_back_with_its_calculator_parts(url):
    SEEN.clear()
    out = io.StringIO()
    code = chat(args(url, system="be brief", max_tokens=20, api_key="k"), io.StringIO("what is 6*7\nand now\n\n"), out)
    assert code == 0
    assert out.getvalue() == "> It is [python: 6*7][python_output: 42] 42.\n> turn 2\n> "
    first, second = (s["body"] for s in SEEN)
    assert first["stream"] is True and first["max_tokens"] == 20 and "temperature" not in first
    assert [s["auth"] for s in SEEN] == ["Bearer k", "Bearer k"]
    assert second["messages"] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 6*7"},
        {"role": "assistant", "content": "It is  42.", "parts": [
            {"type": "text", "text": "It is "}, {"type": "python", "text": "6*7"},
            {"type": "python_output", "text": "42"}, {"type": "text", "text": " 42."}]},
        {"role": "user", "content": "and now"}]


def test_once_and_errors(url, monkeypatch):
    SEEN.clear()
    out = io.StringIO()
    monkeypatch.setenv("STARTLUX_API_KEY", "from-env")
    assert chat(args(url, once="hello", temperature=0.0), io.StringIO(), out) == 0
    assert out.getvalue() == "turn 1\n" and SEEN[0]["auth"] == "Bearer from-env" and SEEN[0]["body"]["temperature"] == 0
    out = io.StringIO()
    assert chat(args(url, once="forbidden"), io.StringIO(), out) == 1
    assert out.getvalue() == "error: missing or invalid API key\n"
    out = io.StringIO()
    assert chat(args(url, once="fail midway"), io.StringIO(), out) == 1
    assert out.getvalue() == "parerror: the model failed while generating\n"
    # an unanswered turn is not kept: the conversation goes on without it
    SEEN.clear()
    out = io.StringIO()
    assert chat(args(url), io.StringIO("forbidden\nhello\n"), out) == 0
    assert SEEN[-1]["body"]["messages"] == [{"role": "user", "content": "hello"}]
    with socket.socket() as s:          # nothing listens there
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    out = io.StringIO()
    assert chat(args(closed, once="hi"), io.StringIO(), out) == 1
    assert "does not answer" in out.getvalue() and "is the service running?" in out.getvalue()


def test_serve_with_a_chat_checkpoint_runs_a_copy_of_the_config_that_serves_it(tmp_path, monkeypatch,
                                                                                chat_checkpoint):
    """`startlux serve --chat-checkpoint DIR` execs `serve run` on a copy of the config with chat_checkpoint set
    (the README's second command after a conversion); a directory that is no checkpoint stops it first."""
    import yaml

    from cluster import cli

    ran = []
    monkeypatch.setattr(cli.os, "execv", lambda path, argv: ran.append(argv))
    monkeypatch.setattr(cli.os, "environ", dict(os.environ))     # the Ray settings it sets stay in this test
    cli.main(["serve", "serve_config.cpu.yaml", "--chat-checkpoint", chat_checkpoint])
    argv = ran[0]
    assert argv[1] == "run" and argv[2] != "serve_config.cpu.yaml"
    copy = yaml.safe_load(open(argv[2]))
    original = yaml.safe_load(open("serve_config.cpu.yaml"))
    assert copy["applications"][0]["args"] == {**original["applications"][0]["args"],
                                               "chat_checkpoint": chat_checkpoint}
    assert {k: v for k, v in copy.items() if k != "applications"} == \
        {k: v for k, v in original.items() if k != "applications"}
    os.remove(argv[2])
    with pytest.raises(SystemExit, match="not a chat checkpoint"):
        cli.main(["serve", "serve_config.cpu.yaml", "--chat-checkpoint", str(tmp_path)])
