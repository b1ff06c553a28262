"""bench/sse.py, the load generator's lean HTTP client, against a real uvicorn server."""
import asyncio
import json

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from bench.sse import Connection, HTTPStatusError
from tests.local_server import local_server


async def stream(request):
    body = await request.json()

    async def events():
        for i in range(body["n"]):
            yield f"data: {json.dumps({'i': i, 'pad': 'x' * body.get('pad', 0)})}\n\n"
            await asyncio.sleep(0)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def plain(request):
    body = await request.json()
    if body.get("bad"):
        return JSONResponse({"error": {"message": "bad input"}}, status_code=400)
    return JSONResponse({"echo": body})


@pytest.fixture(scope="module")
def server_url():
    with local_server(Starlette(routes=[Route("/stream", stream, methods=["POST"]), Route("/plain", plain, methods=["POST"])])) as url:
        yield url


def test_lines_status_and_keep_alive(server_url):
    async def run():
        conn = Connection(server_url)
        try:
            first = [line async for line in conn.post_lines("/stream", {"n": 5, "pad": 70000})]   # chunks > 64 KiB
            writer = conn.writer
            second = [line async for line in conn.post_lines("/stream", {"n": 3})]
            with pytest.raises(HTTPStatusError) as err:
                [line async for line in conn.post_lines("/plain", {"bad": True})]
            echo = [line async for line in conn.post_lines("/plain", {"x": 1})]
            return first, second, err.value.status, echo, writer is conn.writer
        finally:
            conn.close()

    first, second, status, echo, same_connection = asyncio.run(run())
    data = [json.loads(line[6:]) for line in first if line.startswith("data: {")]
    assert [d["i"] for d in data] == list(range(5)) and all(len(d["pad"]) == 70000 for d in data)
    assert first[-2:] == ["data: [DONE]", ""]
    assert [json.loads(line[6:])["i"] for line in second if line.startswith("data: {")] == [0, 1, 2]
    assert status == 400
    assert json.loads(echo[0]) == {"echo": {"x": 1}}
    assert same_connection


def test_stream_tally_counts_tokens_from_usage_and_chunks_without_it(monkeypatch):
    """A chunk may carry several tokens: the usage chunk's count wins; without one, each output chunk is one."""
    import bench.sse as sse

    clock = iter([1.0, 1.5, 2.0])
    monkeypatch.setattr(sse.time, "perf_counter", lambda: next(clock))
    chunk = lambda delta: "data: " + json.dumps({"choices": [{"index": 0, "delta": delta}]})   # noqa: E731
    lines = [chunk({"role": "assistant"}), chunk({"content": "Once upon"}), "", chunk({"content": " a time"}),
             chunk({"parts": [{"type": "tool_call", "text": "1+1"}]}), chunk({}),
             "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": 9}}), "data: [DONE]"]
    with_usage = sse.StreamTally()
    for line in lines:
        with_usage.line(line)
    assert with_usage.times == [1.0, 1.5, 2.0] and with_usage.tokens == 9
    assert with_usage.tpot() == pytest.approx(1.0 / 8)
    clock = iter([1.0, 1.5, 2.0])
    without = sse.StreamTally()
    for line in lines[:-2]:
        without.line(line)
    assert without.tokens == 3 and without.tpot() == pytest.approx(0.5)
    assert sse.StreamTally().tpot() is None


def test_closed_loop_counts_answers_and_checks_their_status(server_url):
    """bench.sse.closed_loop, the decision benchmarks' load: every body answered once, on keep-alive
    connections, with the status it expects (a refusal counts when refusals are what it measures)."""
    from bench.sse import closed_loop

    got = asyncio.run(closed_loop(server_url, [{"i": i} for i in range(40)], 4, path="/plain"))
    assert got["requests"] == 40 and got["requests_per_s"] > 0 and got["p99_ms"] >= got["p50_ms"] > 0
    assert asyncio.run(closed_loop(server_url, [{"bad": 1}] * 6, 3, path="/plain", expect=400))["requests"] == 6
    with pytest.raises(RuntimeError, match="status 400"):
        asyncio.run(closed_loop(server_url, [{"bad": 1}], 1, path="/plain"))
