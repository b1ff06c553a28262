"""The Ray Serve application end to end over HTTP: one in-process Serve instance for the whole module."""
import asyncio
import collections
import os
import math
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import yaml
from hypothesis import HealthCheck, given, settings
import pytest
import torch

from core.chat import load_chat_model, load_chat_tokenizer, save_chat_model
from core.chat.async_engine import STATS_PERIOD_S
from tests.conftest import delete_apps, tiny_model
from tests.decision_fixtures import build_checkpoint
from tests.systemone_requests import REQUESTS, check_answers
from tests.waiting import wait_until

pytestmark = pytest.mark.serve

MAX_ROWS = 8
CHECKPOINTS: dict[str, str] = {}        # the service fixture's checkpoints, for references


@pytest.fixture(scope="module")
def service(serve_url, tmp_path_factory, tokenizer):
    from ray import serve

    from deployments.app import AppArgs, wire

    root = tmp_path_factory.mktemp("serve")
    model = tiny_model("nanochat", tokenizer, sequence_len=8192)
    with torch.no_grad():   # never end on its own: streams run as long as max_tokens says
        model.lm_head.weight[min(tokenizer.special_tokens.values()):] = 0.0
    save_chat_model(str(root / "chat"), model, tokenizer)
    CHECKPOINTS["chat"] = str(root / "chat")
    build_checkpoint(str(root / "decision"))
    CHECKPOINTS["decision"] = str(root / "decision")
    small = {"ray_actor_options": {"num_cpus": 0.1}}
    options = {"ChatModel": dict(small, max_ongoing_requests=64, max_queued_requests=64),
               "DecisionModel": dict(small, max_ongoing_requests=16, max_queued_requests=64,
                                     user_config={"max_batch_size": 16, "batch_wait_timeout_s": 0.05}),
               "Ingress": dict(small, max_ongoing_requests=256)}
    # fp32 whatever this CPU computes natively: the tests compare the service with in-process fp32 references
    args = dict(chat_checkpoint=str(root / "chat"), decision_checkpoint=str(root / "decision"), device="cpu",
                chat_dtype="float32", chat_max_rows=MAX_ROWS, chat_max_waiting=16, max_body_bytes=20_000,
                max_messages=16, max_message_chars=2000, chat_stream_interval=3,
                decision_model_aliases=["jev-latest"])   # tokens grouped after the first text
    keyed = dict(args, api_keys=["sekrit"], chat_max_rows=2, max_chat_inflight=2, max_chat_waiting=1,
                 refusal_delay_s=0.2, token_channel=False)   # every chat message through Serve
    serve.run_many([serve.RunTarget(wire(AppArgs(**args), options), name="open", route_prefix="/"),    # together
                    serve.RunTarget(wire(AppArgs(**keyed), options), name="keyed", route_prefix="/keyed")])
    yield serve_url
    delete_apps("open", "keyed")


def chat(url, payload, **kw):
    return httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=120, **kw)


def user(text="hello how are you"):
    return [{"role": "user", "content": text}]


def sse_events(lines):
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_health_and_models(service):
    assert httpx.get(f"{service}/healthz").json() == {"status": "ok", "models": {"chat": "ok", "startlux-decision": "ok"}}
    ids = [m["id"] for m in httpx.get(f"{service}/v1/models").json()["data"]]
    assert ids == ["chat", "startlux-decision", "jev-latest"]


def test_non_stream_completion_and_seed(service):
    body = {"messages": user(), "max_tokens": 12, "temperature": 1.0, "seed": 5, "n": 2}
    a, b = chat(service, body).json(), chat(service, body).json()
    assert [c["message"]["content"] for c in a["choices"]] == [c["message"]["content"] for c in b["choices"]]
    assert len(a["choices"]) == 2 and a["choices"][0]["finish_reason"] == "length"
    assert a["usage"]["completion_tokens"] == 24 and a["usage"]["prompt_tokens"] > 0


def test_stream_over_sse(service):
    body = {"messages": user(), "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{service}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["usage"]["completion_tokens"] == 8 and chunks[-1]["choices"] == []
    assert any(c["choices"] and c["choices"][0]["finish_reason"] == "length" for c in chunks)


def test_openai_client(service):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{service}/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(model="chat", messages=user(), max_tokens=6, seed=3, temperature=0.8, n=2)
    again = client.chat.completions.create(model="chat", messages=user(), max_tokens=6, seed=3, temperature=0.8, n=2)
    assert [c.message.content for c in out.choices] == [c.message.content for c in again.choices]
    assert out.usage.completion_tokens == 12
    text = ""
    stream = client.chat.completions.create(model="chat", messages=user(), max_tokens=6, stream=True, seed=3,
                                            temperature=0.8)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    single = client.chat.completions.create(model="chat", messages=user(), max_tokens=6, seed=3, temperature=0.8)
    assert text == single.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=user(), max_tokens=3)


def test_sixteen_concurrent_streams_interleave(service):
    async def one(client, i):
        times, finish = [], None
        body = {"messages": user(f"the cat {i}"), "max_tokens": 40, "stream": True}
        async with client.stream("POST", f"{service}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    times.append(time.monotonic())
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
        return times, finish

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    results = asyncio.run(main())
    assert all(finish == "length" for _, finish in results), [(len(t), f) for t, f in results]
    spans = sorted((t[0], t[-1]) for t, _ in results)
    overlapping = sum(1 for (s1, e1), (s2, e2) in zip(spans, spans[1:]) if s2 < e1)
    assert overlapping >= 8, "streams must run side by side, not one after another"


def choices_of_stream(url, body, headers=None) -> tuple[dict, dict]:
    """A streamed chat completion gathered per choice: {index: (text, [(token, logprob, top tokens)],
    finish_reason)} and the usage chunk."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=180) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    text, logprobs, finish, usage = collections.defaultdict(str), collections.defaultdict(list), {}, None
    for chunk in events[:-1]:
        assert "error" not in chunk, chunk
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            text[c["index"]] += c["delta"].get("content") or ""
            for entry in (c.get("logprobs") or {}).get("content") or []:
                logprobs[c["index"]].append((entry["token"], entry["logprob"],
                                             [t["token"] for t in entry["top_logprobs"]]))
            finish[c["index"]] = c["finish_reason"] or finish.get(c["index"])
    return {i: (text[i], logprobs[i], finish[i]) for i in text}, usage


def test_streams_on_the_token_channel_match_streams_through_serve(service):
    """Ten streams at once on the open app, where the chat replica sends every message after a stream's first on
    the Ingress's token channel, give per choice the text, logprobs, finish and usage that the same requests give
    one at a time on the keyed app, which has the channel off (every message a Serve message). The channel
    carried them in frames that each hold several streams' messages."""
    key = {"Authorization": "Bearer sekrit"}
    channel = lambda: httpx.get(f"{service}/debug/stats").json()["ingress"]["token_channel"]   # noqa: E731
    assert httpx.get(f"{service}/keyed/debug/stats", headers=key).json()["ingress"]["token_channel"] is None
    bodies = [{"messages": user(f"the cat {i} sat"), "max_tokens": 20 + i, "temperature": 1.0, "seed": i,
               "n": 1 + i % 2, "logprobs": True, "top_logprobs": 2} for i in range(10)]
    before = channel()
    with ThreadPoolExecutor(len(bodies)) as pool:
        got = list(pool.map(lambda b: choices_of_stream(service, b), bodies))
    after = channel()
    expected = [choices_of_stream(f"{service}/keyed", b, headers=key) for b in bodies]
    for body, (choices, usage), (ref, ref_usage) in zip(bodies, got, expected):
        assert usage == ref_usage and choices.keys() == ref.keys(), body
        for (text, logprobs, finish), (ref_text, ref_logprobs, ref_finish) in zip(choices.values(), ref.values()):
            assert (text, finish) == (ref_text, ref_finish) == (text, "length"), body
            # the same tokens; their logprobs as batches of other sizes compute them
            assert [(t, top) for t, _, top in logprobs] == [(t, top) for t, _, top in ref_logprobs], body
            assert [lp for _, lp, _ in logprobs] == pytest.approx([lp for _, lp, _ in ref_logprobs], abs=1e-3)
    frames, messages = after["frames"] - before["frames"], after["messages"] - before["messages"]
    assert after["connections"] >= 1 and after["open_streams"] == 0
    # each request's messages after its first came on the channel (3 tokens a message after the first text)
    assert messages >= sum((20 + i) * (1 + i % 2) // 3 - 2 for i in range(10)) // 2, (messages, frames)
    assert frames < messages, "a frame carries the messages of every stream that had one in that loop turn"


def test_disconnect_frees_rows_for_waiting_request(service):
    stats = lambda: httpx.get(f"{service}/debug/stats").json()["chat"]   # noqa: E731
    long = {"messages": user(), "max_tokens": 8000, "stream": True}
    clients = [httpx.Client(timeout=120) for _ in range(MAX_ROWS)]
    streams = []
    try:
        for c in clients:
            s = c.stream("POST", f"{service}/v1/chat/completions", json=long)
            r = s.__enter__()
            lines = r.iter_lines()      # keep the iterator: dropping it closes the connection
            next(lines)
            streams.append((s, lines))
        result = {}

        def waiter():
            result["response"] = chat(service, {"messages": user(), "max_tokens": 3})

        t = threading.Thread(target=waiter)
        t.start()
        seen = wait_until(lambda: (s := stats())["waiting"] >= 1 and s, 20, lambda: f"no request waiting: {stats()}",
                          0.02)
        assert seen["waiting"] == 1 and seen["rows_used"] == MAX_ROWS, seen
        assert not result, "the waiting request must not run while every row is taken"
        streams[0][0].__exit__(None, None, None)      # the client goes away mid-stream
        clients[0].close()
        t.join(timeout=30)                            # the freed row goes to the waiting request
        assert not t.is_alive() and result["response"].status_code == 200
        assert result["response"].json()["usage"]["completion_tokens"] == 3
    finally:
        for s, _ in streams[1:]:
            s.__exit__(None, None, None)
        for c in clients:
            c.close()
    wait_until(lambda: stats()["rows_used"] == 0, 20, "every disconnected stream must give its rows back", 0.1)


def decision_body(i=0):
    return {"state": f"the cat is red {i}",
            "questions": {"color": {"question": "which color", "criteria": {"r": "red", "b": "blue"}},
                          "cat": {"type": "noul", "question": "is there a cat"}}}


def test_decisions_are_batched(service):
    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(f"{service}/v1/systemone", json=decision_body(i))
                                          for i in range(12)))

    responses = asyncio.run(main())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    one = responses[0].json()
    assert list(one["answers"]) == ["color", "cat"] and one["usage"]["input_tokens"] > 0
    assert one["answers"]["color"]["choice"] in ("r", "b") and 0 <= one["answers"]["cat"]["noul"] <= 1
    stats = httpx.get(f"{service}/debug/stats").json()["decision"]
    assert stats["largest_batch"] > 1

    # closed-loop clients: what arrives while a batch runs goes into the next one (Serve alone formed batches of
    # one 10 ms wait each, which then queued), so there are far fewer batches than requests
    async def closed_loop():
        async with httpx.AsyncClient(timeout=60) as client:
            async def one_client(c):
                for k in range(6):
                    r = await client.post(f"{service}/v1/systemone", json=decision_body(100 * c + k))
                    assert r.status_code == 200, r.text
            await asyncio.gather(*(one_client(c) for c in range(8)))

    before = httpx.get(f"{service}/debug/stats").json()["decision"]["batches"]
    asyncio.run(closed_loop())
    after = httpx.get(f"{service}/debug/stats").json()["decision"]
    assert after["scorer"] == "ProcessScorer"
    assert after["batches"] - before <= 48 / 2, after


def test_repeated_state_is_served_from_the_prefix_cache(service):
    body = {"state": "a long shared document " * 40, "questions": {"q": {"instructions": "which", "criteria": {
        "a": "x", "b": "y"}}, "n": {"type": "noul", "instructions": "is it"}}}
    first = httpx.post(f"{service}/v1/systemone", json=body, timeout=60).json()
    again = httpx.post(f"{service}/v1/systemone", json=body, timeout=60).json()
    assert first["usage"]["input_tokens"] == again["usage"]["input_tokens"]
    assert first["usage"]["input_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["input_tokens_details"]["cached_tokens"] > 0.8 * again["usage"]["input_tokens"]
    assert again["answers"] == first["answers"]
    cache = httpx.get(f"{service}/debug/stats").json()["decision"]["prefix_cache"]
    assert cache["hit_tokens"] > 0 and 0 < cache["bytes"] <= cache["capacity_bytes"]


def decide_job_config(tmp_path, **args) -> str:
    """A Serve config for `startlux decide` with the service's decision model and its limits (the fixture's)."""
    app = {"decision_checkpoint": CHECKPOINTS["decision"], "device": "cpu", "decision_model_aliases": ["jev-latest"],
           "max_body_bytes": 20_000, "decision_torch_threads": 1, **args}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"applications": [{"args": app}]}))
    return str(path)


def test_a_decide_job_answers_as_the_service_does(service, tmp_path):
    """`startlux decide` over a few hundred rows (JSON Lines in, and the same as Parquet) on the Ray instance the
    service runs on: every row in input order, answered (within float noise: other batches) or refused with the
    very body the service answers it with."""
    from bench.decision import cheap_workload
    from cluster.decide import run

    rows = [json.dumps(r) for r in cheap_workload(200, 7)] + [json.dumps(r) for r in REQUESTS.values()] + [
        '{"state": "s", "questions": {"q": {"type": "vote"}, "ok": {"type": "noul"}}}', "[1, 2", "[]",
        '{"model": "gpt-9", "state": "s", "questions": {"a": {"type": "noul"}}}', '{"questions": {}}',
        json.dumps({"model": "jev-latest", "state": "x" * 30_000, "questions": {"a": {"type": "noul"}}}),
        json.dumps({"state": "s", "questions": {"a": {"type": "noul"}}, "assets": ["img"]})]
    (tmp_path / "in.jsonl").write_text("\n".join(rows) + "\n\n")       # a blank line is no request
    config = decide_job_config(tmp_path)
    summary = run(str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), config, actors=2, batch_size=16, quiet=True)
    got = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]

    async def ask():
        async with httpx.AsyncClient(timeout=120) as client:
            sem = asyncio.Semaphore(16)

            async def one(body):
                async with sem:
                    r = await client.post(f"{service}/v1/systemone", content=body,
                                          headers={"content-type": "application/json"})
                    return r.status_code, r.json()
            return await asyncio.gather(*(one(b) for b in rows))
    want = asyncio.run(ask())
    assert len(got) == len(rows) == summary["rows"] and summary["refused"] == sum(s != 200 for s, _ in want) == 7
    for i, (g, (status, w)) in enumerate(zip(got, want)):
        if status != 200:
            assert g == w, i
            continue
        assert g["model"] == w["model"] and list(g["answers"]) == list(w["answers"]), i
        assert g["usage"]["input_tokens"] == w["usage"]["input_tokens"], i
        for k, a in g["answers"].items():
            b = w["answers"][k]
            assert a["type"] == b["type"] and set(a) == set(b), (i, k)
            for field in ("noul", "score", "confidence"):
                if field in a:
                    assert a[field] == pytest.approx(b[field], abs=1e-4), (i, k, field)
            if "probabilities" in a:
                assert a["probabilities"] == pytest.approx(b["probabilities"], abs=1e-4), (i, k)
    import pyarrow as pa
    import pyarrow.parquet as pq

    tail = slice(len(rows) - 40, None)                    # the client shapes and the refusals, as Parquet
    pq.write_table(pa.table({"request": rows[tail]}), tmp_path / "in.parquet")
    run(str(tmp_path / "in.parquet"), str(tmp_path / "out.parquet"), config, actors=1, quiet=True)
    table = pq.read_table(tmp_path / "out.parquet").to_pydict()
    assert table["status"] == [s for s, _ in want[tail]]
    assert [json.loads(r) for r, (s, _) in zip(table["response"], want[tail]) if s != 200] == \
        [g for g, (s, _) in zip(got[tail], want[tail]) if s != 200]


def test_a_decide_job_survives_an_actor_killed_mid_job(serve_url, tmp_path):
    """An actor of the job's pool killed mid-job (by its pid): Ray Data restarts it and runs its batch again, and
    every row is answered exactly once, in input order (each row's choice names the row). The synthetic scorer
    makes each batch last."""
    import signal
    import threading

    from ray._private import state

    from cluster.decide import run

    n = 300
    rows = [json.dumps({"state": f"row {i}", "questions": {"which": {"criteria": {f"r{i}": "this", "z": "that"}}}})
            for i in range(n)]
    (tmp_path / "in.jsonl").write_text("\n".join(rows) + "\n")
    config = decide_job_config(tmp_path, decision_scorer="synthetic", decision_synthetic_question_s=0.03)
    done: dict = {}
    job = threading.Thread(target=lambda: done.update(run(str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"),
                                                         config, actors=2, batch_size=6, quiet=True)))
    job.start()

    def pool() -> list[int]:
        return [a["Pid"] for a in state.actors().values()
                if "DecideBatch" in a["ActorClassName"] and a["State"] == "ALIVE" and a.get("Pid")]
    pids = wait_until(lambda: len(pool()) == 2 and pool(), 120, lambda: f"actors: {state.actors()}")
    time.sleep(1.5)                                   # batches under way
    assert job.is_alive(), "the job ended before an actor could be killed"
    os.kill(pids[0], signal.SIGKILL)
    job.join(300)
    assert not job.is_alive() and done["rows"] == n and done["refused"] == 0
    got = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [g["answers"]["which"]["choice"] for g in got] == [f"r{i}" for i in range(n)]
    assert pids[0] not in pool()


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_real_client_requests(service, name):
    r = httpx.post(f"{service}/v1/systemone", json=REQUESTS[name], timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "startlux-decision"
    assert body["usage"]["input_tokens"] > 0 and body["usage"]["output_tokens"] == 0
    check_answers(REQUESTS[name], body["answers"])


@pytest.mark.parametrize("payload,status,needle", [
    ("{not json", 400, "malformed JSON"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ({"messages": []}, 400, "messages"),
    ({"messages": user(), "temperature": 5}, 400, "temperature"),
    ({"messages": user(), "top_p": 0}, 400, "top_p"),
    ({"messages": user(), "repetition_penalty": 5e-324}, 400, "repetition_penalty"),   # found by the fuzzer
    ({"messages": user(), "n": 50}, 400, "n must be at most"),
    ({"messages": user(), "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": user(), "max_tokens": 99999}, 400, "max_tokens"),
    ({"messages": user() * 20}, 400, "at most 16 messages"),
    ({"messages": user("x" * 3000)}, 400, "messages[0]"),
    ({"messages": user("the cat " * 200), "max_tokens": 8150}, 400, "newest user message"),
    ({"messages": user(), "model": "nope"}, 404, "unknown model"),
    ({"messages": user("x" * 30000)}, 413, "body over"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, 400, "last non-system message"),
])
def test_chat_bad_input(service, payload, status, needle):
    if isinstance(payload, str):
        r = httpx.post(f"{service}/v1/chat/completions", content=payload,
                       headers={"content-type": "application/json"})
    else:
        r = chat(service, payload)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and set(err) >= {"message", "type", "param", "code"}


def test_decision_bad_input_names_every_key(service):
    body = {"state": "s", "questions": {"ok": {"question": "q", "criteria": {"a": "x", "b": "y"}},
                                        "bad1": {"type": "choice", "question": "q", "criteria": {}},
                                        "bad2": {"type": "score", "question": "q", "criteria": ["one"]}}}
    r = httpx.post(f"{service}/v1/systemone", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert "'bad1'" in err["message"] and "'bad2'" in err["message"] and set(err["errors"]) == {"bad1", "bad2"}
    r = httpx.post(f"{service}/v1/systemone", json={"state": "s", "questions": {"q": {"type": "vote", "question": "q"}}})
    assert r.status_code == 400 and "'q'" in r.json()["error"]["message"] and "unknown type 'vote'" in r.text
    both = {"state": "s", "questions": {"q": {"type": "noul", "question": "a", "instructions": "a"}}}
    r = httpx.post(f"{service}/v1/systemone", json=both)
    assert r.status_code == 400 and "not both" in r.json()["error"]["errors"]["q"]
    r = httpx.post(f"{service}/v1/systemone", json=dict(decision_body(), assets={"img-1": {"data_base64": "AAAA"}}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "assets" and "not supported" in r.text
    r = httpx.post(f"{service}/v1/systemone", json=dict(decision_body(), extra_field=1))
    assert r.status_code == 400 and "extra_field" in r.text


def test_unknown_route_and_method(service):
    r = httpx.get(f"{service}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_overload_is_503_with_retry_after(service):
    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            chats = [client.post(f"{service}/v1/chat/completions", json={"messages": user(), "max_tokens": 300})
                     for _ in range(40)]
            return await asyncio.gather(*chats)

    responses = asyncio.run(main())
    codes = {r.status_code for r in responses}
    assert codes <= {200, 503} and 503 in codes and 200 in codes
    busy = next(r for r in responses if r.status_code == 503)
    assert busy.headers["retry-after"] and busy.json()["error"]["type"] == "overloaded_error"


def test_api_keys(service):
    url = f"{service}/keyed"
    assert httpx.get(f"{url}/healthz").status_code == 200
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": user(), "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": user(), "max_tokens": 2},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": user(), "max_tokens": 2},
                   headers={"Authorization": "Bearer sekrit"})
    assert r.status_code == 200
    assert httpx.post(f"{url}/v1/systemone", json=decision_body()).status_code == 401
    assert httpx.get(f"{service}/v1/models").status_code == 200   # the open app has no keys


def test_decision_model_field(service):
    for name in ("startlux-decision", "jev-latest"):     # the configured name and its alias
        r = httpx.post(f"{service}/v1/systemone", json=dict(decision_body(), model=name))
        assert r.status_code == 200 and r.json()["model"] == "startlux-decision"
    models = {m["id"]: m for m in httpx.get(f"{service}/v1/models").json()["data"]}
    assert models["jev-latest"]["alias_of"] == "startlux-decision"
    r = httpx.post(f"{service}/v1/systemone", json=dict(decision_body(), model="other"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# ---- the rest of OpenAI's API: logprobs, text completions, penalties and bias, parameters refused by name

def openai_client(service):
    openai = pytest.importorskip("openai")
    return openai, openai.OpenAI(base_url=f"{service}/v1", api_key="unused", max_retries=0)


def test_chat_logprobs_streamed_and_not(service):
    _, client = openai_client(service)
    kw = dict(model="chat", messages=user(), max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    out = client.chat.completions.create(**kw)
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens == 8
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert e.logprob <= 0 and tops == sorted(tops, reverse=True) and len(tops) == 3
        assert e.top_logprobs[0].token == e.token and abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6
        assert sum(math.exp(v) for v in tops) <= 1 + 1e-6 and e.bytes == list(e.token.encode()) or "\ufffd" in e.token
    assert "".join(e.token for e in entries) == out.choices[0].message.content
    streamed = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed += chunk.choices[0].logprobs.content
    # the same tokens; the logprobs agree to float noise (the second request reuses the first's cached prompt)
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, entries))
    plain = client.chat.completions.create(model="chat", messages=user(), max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == out.choices[0].message.content
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


def test_text_completions(service):
    _, client = openai_client(service)
    greedy = dict(model="chat", max_tokens=6, temperature=0)
    one = client.completions.create(prompt="the cat sat on", **greedy)
    assert one.object == "text_completion" and one.choices[0].text and one.usage.completion_tokens == 6
    tokens = httpx.post(f"{service}/v1/completions", json={"prompt": "the cat sat on", "max_tokens": 1,
                                                           "temperature": 0, "logprobs": 0}).json()
    assert tokens["choices"][0]["logprobs"]["tokens"]
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt="the cat sat on", stream=True,
                                                                             **greedy) if c.choices)
    assert streamed == one.choices[0].text
    several = client.completions.create(prompt=["the cat sat on", "hello how are"], n=2, **greedy)
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert several.choices[0].text == several.choices[1].text == one.choices[0].text
    assert several.usage.completion_tokens == 24
    echo = client.completions.create(prompt="the cat sat on", echo=True, **greedy)
    assert echo.choices[0].text == "the cat sat on" + one.choices[0].text
    ids = client.completions.create(prompt=[[5, 6, 7]], echo=True, **greedy)
    assert ids.usage.prompt_tokens == 4                       # <|bos|> is prepended
    seeded = [client.completions.create(model="chat", prompt="hello", max_tokens=6, temperature=1.0, seed=7, n=2) for _ in range(2)]
    assert [c.text for c in seeded[0].choices] == [c.text for c in seeded[1].choices]
    legacy = client.completions.create(model="chat", prompt="hello", max_tokens=4, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(len(t) == 2 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)


@pytest.mark.parametrize("body,status,needle", [
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [[99999]]}, 400, "vocabulary"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "the cat " * 200, "max_tokens": 8000}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0, "logprobs": 1}, 400, "echo"),      # scoring without echo shows nothing
    ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"prompt": "x", "model": "nope"}, 404, "unknown model"),
    ({"prompt": ["a"] * 5, "n": 2}, 400, "prompts x n"),
])
def test_text_completion_errors(service, body, status, needle):
    r = httpx.post(f"{service}/v1/completions", json=body, timeout=60)
    assert r.status_code == status and needle in r.json()["error"]["message"], r.text


def test_penalties_and_logit_bias(service):
    _, client = openai_client(service)
    biased = client.chat.completions.create(model="chat", messages=user(), max_tokens=5, temperature=0,
                                            logit_bias={"300": 100})
    assert biased.usage.completion_tokens == 5
    tokens = httpx.post(f"{service}/v1/completions", json={"prompt": "hello", "max_tokens": 5, "temperature": 0,
                                                           "logit_bias": {"300": 100}, "logprobs": 0}).json()
    assert len(set(tokens["choices"][0]["logprobs"]["tokens"])) == 1          # one token, every time
    base = client.chat.completions.create(model="chat", messages=user(), max_tokens=12, temperature=0)
    penalized = client.chat.completions.create(model="chat", messages=user(), max_tokens=12, temperature=0,
                                               frequency_penalty=2.0, presence_penalty=2.0)
    assert penalized.usage.completion_tokens == 12 and base.usage.completion_tokens == 12
    for body, field in [({"frequency_penalty": 3}, "frequency_penalty"), ({"presence_penalty": -2.5}, "presence_penalty"),
                        ({"logit_bias": {"5": 200}}, "logit_bias"), ({"logit_bias": {"999999": 1}}, "logit_bias"),
                        ({"repetition_penalty": 0}, "repetition_penalty"), ({"top_logprobs": 2}, "top_logprobs")]:
        r = chat(service, {"messages": user(), **body})
        assert r.status_code == 400 and field in r.json()["error"]["message"], (body, r.text)


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]), ("tool_choice", "auto"),
    ("functions", [{"name": "f"}]), ("response_format", {"type": "regex"}),
    ("audio", {"voice": "x", "format": "wav"}), ("modalities", ["text", "audio"]), ("prediction", {"type": "content"}),
    ("web_search_options", {}), ("some_new_knob", 1), ("guided_json", {"type": "object"}), ("guided_choice", ["a"]),
])
def test_unsupported_parameters_are_refused_by_name(service, field, value):
    r = chat(service, {"messages": user(), field: value})
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    accepted = chat(service, {"messages": user(), "max_tokens": 2, "user": "u", "metadata": {"a": "b"},
                              "store": False, "response_format": {"type": "text"}})
    assert accepted.status_code == 200


def test_multi_turn_chat_reuses_the_previous_turn(service):
    """The second turn finds the first turn's prompt cached, in whole blocks."""
    block = httpx.get(f"{service}/debug/stats").json()["chat"]["kv_cache"]["block_size"]
    said = "the cat sat on a mat by the door of the old house at the end of the long road"
    first = chat(service, {"messages": user(said), "max_tokens": 8, "temperature": 0}).json()
    history = user(said) + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                            {"role": "user", "content": "and the dog"}]
    second = chat(service, {"messages": history, "max_tokens": 8, "temperature": 0}).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens"] >= 2 * block
    assert cached >= first["usage"]["prompt_tokens"] // block * block and cached < second["usage"]["prompt_tokens"]
    stats = httpx.get(f"{service}/debug/stats").json()["chat"]["prefix_cache"]
    assert stats["hit_tokens"] >= cached and stats["query_tokens"] >= stats["hit_tokens"]


def test_interleaved_conversations_find_their_whole_history_cached(service):
    """Twelve conversations with one system prompt (every prompt begins with the same template tokens), sent as
    users send them: turn 1 of each, then turn 2 of each, then turn 3, more conversations than the engine has
    rows. Every later turn finds at least its previous prompt in the cache, in whole blocks."""
    block = httpx.get(f"{service}/debug/stats").json()["chat"]["kv_cache"]["block_size"]
    system = {"role": "system", "content": "You are a terse assistant for a small shop that sells tea and cups."}
    histories = [[system, {"role": "user", "content": f"customer {i} asks about green tea"}] for i in range(12)]
    previous = [0] * len(histories)
    for turn in range(3):
        for i, h in enumerate(histories):
            body = chat(service, {"messages": h, "max_tokens": 6, "temperature": 0}).json()
            usage = body["usage"]
            if turn:
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                assert cached >= previous[i] // block * block, (turn, i, cached, previous[i], usage)
            previous[i] = usage["prompt_tokens"]
            h += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                  {"role": "user", "content": f"and cups, turn {turn}?"}]


def affinity_app(base: Path) -> tuple[dict, dict]:
    """The application's arguments and deployment options with two chat replicas behind the conversation-affinity
    router, on the module's checkpoints under `base` (pytest's base temporary directory). Every deployment
    drains for up to 60 s when replaced, as serve_config.yaml lets them (the redeploy test replaces them)."""
    chat_dir = next(base.glob("serve*/chat"))
    # Serve's default drain of 20 s killed a replaced Ingress on a busy host while a decision waited for the new
    # decision replica (the proxy's 500)
    small = {"ray_actor_options": {"num_cpus": 0.1}, "graceful_shutdown_timeout_s": 60}
    router = {"request_router_class": "deployments.routing:ConversationAffinityRouter"}
    options = {"ChatModel": dict(small, num_replicas=2, max_ongoing_requests=64, request_router_config=router),
               "DecisionModel": dict(small, max_ongoing_requests=16,
                                     user_config={"max_batch_size": 4, "batch_wait_timeout_s": 0.01}),
               "Ingress": dict(small, max_ongoing_requests=256)}
    args = dict(chat_checkpoint=str(chat_dir), decision_checkpoint=str(chat_dir.parent / "decision"), device="cpu",
                chat_dtype="float32", chat_max_rows=MAX_ROWS, max_body_bytes=200_000, max_message_chars=4000)
    return args, options


@pytest.fixture(scope="module")
def affinity(service, tmp_path_factory, tokenizer):
    """The same application with two chat replicas behind the conversation-affinity router."""
    from ray import serve

    from deployments.app import AppArgs, wire

    args, options = affinity_app(tmp_path_factory.getbasetemp())
    serve.run(wire(AppArgs(**args), options), name="affinity", route_prefix="/affinity")
    yield f"{service}/affinity"
    serve.delete("affinity")


def conversation_hit_rate(url, conversations, turns):
    """Every conversation sends its turns in step with the others; -> (cached / prompt tokens over turns 2+,
    [(cached, prompt) of each request] per turn)."""
    async def main():
        histories = [[{"role": "user", "content": c}] for c in conversations]
        per_turn = []
        async with httpx.AsyncClient(timeout=120) as client:
            for turn in range(turns):
                rs = await asyncio.gather(*(client.post(f"{url}/v1/chat/completions", json={
                    "messages": h, "max_tokens": 6, "temperature": 0}) for h in histories))
                per_turn.append([])
                for h, r in zip(histories, rs):
                    body = r.json()
                    usage = body["usage"]
                    per_turn[-1].append((usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]))
                    h += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                          {"role": "user", "content": f"and then {turn}"}]
        later = [x for turn in per_turn[1:] for x in turn]
        return sum(c for c, _ in later) / sum(p for _, p in later), per_turn

    return asyncio.run(main())


def test_conversations_stay_on_the_replica_that_holds_them(service, affinity):
    conversations = [f"conversation {i} about the red cat" for i in range(8)]
    one, _ = conversation_hit_rate(service, conversations, 4)
    two, turns = conversation_hit_rate(affinity, [c + " again" for c in conversations], 4)
    replicas = chat_stats_by_replica(affinity)
    # on a failure, the (cached, prompt) tokens of every request and each replica's engine say what went where
    assert two >= 0.8 * one, (one, two, turns, replicas)
    seen = {r: s["prefix_cache"]["query_tokens"] for r, s in replicas.items()}
    assert len(seen) == 2 and all(q > 0 for q in seen.values()), seen   # both replicas served conversations


def chat_stats_by_replica(url, tries=20):
    """{replica: its chat stats} for the replicas that answer /debug/stats. Two calls at a time: Serve sends a
    call to the less loaded of two replicas, and the first call in flight makes its replica the busier one."""
    seen = {}
    with ThreadPoolExecutor(2) as pool:
        for _ in range(tries):
            for s in pool.map(lambda _: httpx.get(f"{url}/debug/stats", timeout=30).json()["chat"], range(2)):
                seen[s["replica"]] = s
            if len(seen) == 2:
                break
    return seen


def stream_text(url, body, gaps=None, started=None):
    """A streamed chat completion: -> (text, finish_reason, completion_tokens, error events); the longest wait
    between two lines goes into `gaps`; `started` (a threading.Event) is set at the first line."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    lines, last, gap = [], None, 0.0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=180) as r:
        for line in r.iter_lines():
            now = time.monotonic()
            gap, last = max(gap, now - last) if last else 0.0, now
            lines.append(line)
            if started is not None:
                started.set()
    if gaps is not None:
        gaps.append(gap)
    events = sse_events(lines)
    chunks = [e for e in events if isinstance(e, dict) and "error" not in e]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    return (text, finish, usage[-1]["completion_tokens"] if usage else None,
            [e for e in events if isinstance(e, dict) and "error" in e])


def test_streams_continue_on_another_replica_when_theirs_is_killed(service, affinity):
    """Streams run on both chat replicas; one replica is killed mid-way. Every stream still ends normally, and
    greedy and seeded ones give exactly the undisturbed run's text (the Ingress continued them elsewhere), a
    JSON-schema one included (its grammar goes on where it stopped)."""
    import ray

    # long enough that streams still run when the victim is known (within three stats periods, 1.5 s, of the
    # first line; the seven streams together take about 6 s on the 2-core CPU), short enough to run twice
    bodies = [{"messages": user(f"resume {i}"), "max_tokens": 800, "temperature": 0} for i in range(4)] + \
             [{"messages": user(f"resume seeded {i}"), "max_tokens": 800, "temperature": 1.0, "top_k": 50,
               "seed": 40 + i} for i in range(2)]
    digits = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 400}
    bodies.append({"messages": user("resume constrained"), "max_tokens": 500, "temperature": 1.0, "seed": 9,
                   "response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": digits}}})
    with ThreadPoolExecutor(len(bodies)) as pool:           # undisturbed, on the one-replica application
        reference = list(pool.map(lambda b: stream_text(service, b), bodies))
    before = httpx.get(f"{affinity}/debug/stats").json()["ingress"]["chat_streams_continued"]
    prefix = "SERVE_REPLICA::affinity#ChatModel#"            # the replica actors' names (ReplicaID.to_full_id_str)
    replicas = {a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(prefix)}
    assert len(replicas) == 2, replicas
    with ThreadPoolExecutor(len(bodies)) as pool:
        gaps, started = [], threading.Event()
        runs = [pool.submit(stream_text, affinity, b, gaps, started) for b in bodies]
        seen_started = None

        def streaming_replica() -> str | None:
            """A replica that is streaming now, by the stats of whichever replica answers."""
            nonlocal seen_started
            s = httpx.get(f"{affinity}/debug/stats").json()["chat"]
            if seen_started is None and started.is_set():
                seen_started = time.monotonic()
            if s["running"] >= 1:
                return s["replica"]
            if seen_started and time.monotonic() - seen_started > 3 * STATS_PERIOD_S and not gaps:
                # Serve routes a stats call to the less loaded replica: an idle one while streams run means
                # they all run on the other. Its count is the engine's last report (every STATS_PERIOD_S):
                # trusted only once a stream that started on it would have been reported
                return (replicas - {s["replica"]}).pop()
            return None
        victim = wait_until(streaming_replica, 60, "no replica was streaming")
        ray.kill(ray.get_actor(prefix + victim, namespace="serve"), no_restart=True)
        results = [r.result(timeout=300) for r in runs]
    for body, ref, got in zip(bodies, reference, results):
        assert got[3] == [] and got[1] == ["length"], (body, got[1], got[3])
        assert got[:3] == ref[:3], body
    after = httpx.get(f"{affinity}/debug/stats").json()["ingress"]["chat_streams_continued"]
    assert after > before, "no stream was continued: the kill hit nothing"
    # the counter under the name the dashboard and docs give it (tests/test_operations.py checks the rest of the
    # names through Prometheus; this one needs a lost replica), on this node's metrics exporter
    exporter = f"http://127.0.0.1:{ray.nodes()[0]['MetricsExportPort']}/metrics"
    wait_until(lambda: "\nray_chat_streams_continued_total{" in httpx.get(exporter, timeout=10).text, 60,
               "ray_chat_streams_continued_total never reached the exporter", 1)   # reported every few seconds
    print(f"\n{after - before} of {len(bodies)} streams continued on the other replica; the longest pause "
          f"between two lines of a stream: {max(gaps):.2f} s")


# ---- the published OpenAPI schema, fuzzed (schemathesis), on a small-context model so every case is quick

@pytest.fixture
def fuzz_api(service, tmp_path_factory, tokenizer):
    import schemathesis
    from ray import serve

    from deployments.app import AppArgs, wire

    root = tmp_path_factory.mktemp("fuzz")
    save_chat_model(str(root / "chat"), tiny_model("nanochat", tokenizer, sequence_len=128), tokenizer)
    decision_dir = next(tmp_path_factory.getbasetemp().glob("serve*/decision"))
    small = {"ray_actor_options": {"num_cpus": 0.1}}
    options = {"ChatModel": dict(small, max_ongoing_requests=16, max_queued_requests=32),
               "DecisionModel": dict(small, user_config={"max_batch_size": 4, "batch_wait_timeout_s": 0.01}),
               "Ingress": dict(small, max_ongoing_requests=64)}
    args = dict(chat_checkpoint=str(root / "chat"), decision_checkpoint=str(decision_dir), device="cpu",
                chat_dtype="float32", chat_max_rows=4, max_body_bytes=50_000, max_messages=8, max_message_chars=500,
                max_n=2, max_questions=4, decision_max_length=512)
    serve.run(wire(AppArgs(**args), options), name="fuzz", route_prefix="/fuzz")
    url = f"{service}/fuzz"
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    schema.config.update(base_url=url)
    yield schema
    assert httpx.get(f"{url}/healthz", timeout=30).status_code == 200     # healthy after the fuzzing
    serve.delete("fuzz")


FUZZ_EXAMPLES = int(os.environ.get("STARTLUX_FUZZ_EXAMPLES", "25"))   # cases per route; CI runs 25


def test_fuzzed_api(fuzz_api):
    """Every route, schemathesis-generated requests (valid and not): no 5xx, no hang (every call has a timeout),
    every error in OpenAI's shape, every response as the schema says."""
    from schemathesis import checks

    ran = []
    for result in fuzz_api.get_all_operations():
        operation = result.ok()

        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def check(case):
            response = case.call(timeout=60)
            if response.status_code >= 400:
                err = response.json()["error"]
                assert set(err) >= {"message", "type", "param", "code"} and isinstance(err["message"], str)
            case.validate_response(response, checks=[checks.not_a_server_error, checks.status_code_conformance,
                                                     checks.content_type_conformance,
                                                     checks.response_schema_conformance])
            ran.append((operation.label, response.status_code))

        check()
    assert {label for label, _ in ran} >= {"POST /v1/chat/completions", "POST /v1/completions", "POST /v1/systemone",
                                           "GET /v1/models", "GET /healthz"}
    assert any(code == 200 for _, code in ran) and any(code == 400 for _, code in ran)


def test_redeploy_under_load_cuts_no_stream_and_fails_no_decision(affinity, tmp_path_factory):
    """A `serve deploy` that replaces the chat, decision and Ingress replicas of the affinity application while
    streams run: the old replicas drain (finish what they have, up to graceful_shutdown_timeout_s), new requests
    go to the new ones. The module's last use of that application."""
    from ray import serve

    from deployments.app import AppArgs, wire

    args, options = affinity_app(tmp_path_factory.getbasetemp())
    url = affinity
    streams, decisions, started = [], [], threading.Event()

    def stream(i):
        body = {"messages": user(f"hello {i}"), "max_tokens": 400, "stream": True, "temperature": 0}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            events = sse_events(line for line in r.iter_lines() if (started.set() or True))
        streams.append(events)

    def decide():
        while not done.is_set():
            r = httpx.post(f"{url}/v1/systemone", json=decision_body(), timeout=120)
            decisions.append(r.status_code if r.status_code == 200 else (r.status_code, r.text[:500]))

    done = threading.Event()
    workers = [threading.Thread(target=stream, args=(i,)) for i in range(4)] + [threading.Thread(target=decide)]
    [w.start() for w in workers]
    assert started.wait(60)
    old = httpx.get(f"{url}/debug/stats").json()["chat"]["replica"]
    serve.run(wire(AppArgs(**dict(args, chat_stream_interval=2, decision_max_length=60000)), options),
              name="affinity", route_prefix="/affinity")           # new versions of both models
    late = chat(url, {"messages": user("after"), "max_tokens": 4})  # served by the new replicas
    done.set()
    [w.join(timeout=180) for w in workers]
    assert late.status_code == 200
    assert httpx.get(f"{url}/debug/stats").json()["chat"]["replica"] != old     # the replica was replaced
    assert len(streams) == 4
    for events in streams:
        assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
        text = [e for e in events if isinstance(e, dict) and e.get("choices")]
        assert text[-1]["choices"][0]["finish_reason"] == "length"    # ran to max_tokens, not cut
    assert decisions and set(decisions) == {200}, [d for d in decisions if d != 200]


def test_ingress_admission_refuses_before_reading_the_body(service):
    url, auth = f"{service}/keyed", {"Authorization": "Bearer sekrit"}
    body = {"messages": user(), "max_tokens": 2000, "stream": True}
    with httpx.Client(timeout=60, headers=auth) as client:
        streams = [client.stream("POST", f"{url}/v1/chat/completions", json=body) for _ in range(2)]
        for s in streams:                                          # two in flight
            assert s.__enter__().status_code == 200
        waiting = threading.Thread(target=lambda: client.post(f"{url}/v1/chat/completions",
                                                              json=dict(body, stream=False, max_tokens=4)))
        waiting.start()                                            # one waiting in the Ingress
        ingress = lambda: httpx.get(f"{url}/debug/stats", headers=auth).json()["ingress"]   # noqa: E731
        wait_until(lambda: ingress()["chat_waiting"] >= 1, 30, "no request waiting in the Ingress", 0.1)
        counted = ingress()["chat_refused"]
        refused = client.post(f"{url}/v1/chat/completions", content=b"{not json at all",
                              headers={"content-type": "application/json"})
        assert refused.status_code == 503 and refused.headers["retry-after"]   # not a 400: the body was never read
        assert refused.json()["error"]["type"] == "overloaded_error"
        # a wrong key is still told so while the model is full (the early refusal checks the key first)
        wrong = client.post(f"{url}/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer no"})
        assert wrong.status_code == 401
        assert httpx.get(f"{url}/debug/stats", headers=auth).json()["ingress"]["chat_refused"] == counted + 1
        for s in streams:
            s.__exit__(None, None, None)
        waiting.join(timeout=60)
    stats = httpx.get(f"{url}/debug/stats", headers=auth).json()["ingress"]
    assert stats["chat_waiting"] == 0
    wait_until(lambda: not ingress()["chat_in_flight"], 30, "slots are given back when streams end", 0.1)


def test_deep_json_is_a_400_that_names_the_limit(service):
    """5,000 levels of nesting on every route that reads JSON: a 400 naming max_json_depth (Python's parser would
    hit its recursion limit: a 500). A state nested as deep as the limit allows is still answered."""
    deep = "[" * 5000 + "]" * 5000
    bodies = {"/v1/chat/completions": '{"messages": [{"role": "user", "content": "hi"}], "x": %s}' % deep,
              "/v1/completions": '{"prompt": "hi", "x": %s}' % deep,
              "/v1/systemone": '{"state": %s, "questions": {"q": {"type": "noul"}}}' % deep}
    for path, body in bodies.items():
        r = httpx.post(f"{service}{path}", content=body, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "json_too_deep" and "max_json_depth" in err["message"], err
    state = json.loads("[" * 62 + "1" + "]" * 62)             # 62 + the body and `state` keys: 64 levels
    r = httpx.post(f"{service}/v1/systemone", json={"state": state, "questions": {"q": {"type": "noul"}}},
                   timeout=60)
    assert r.status_code == 200, r.text


OPENAI_SCHEMAS = json.loads((Path(__file__).parent / "openai_schema" / "schemas.json").read_text())


def openai_validator(name, patch=None):
    """A validator for schema `name` of OpenAI's document; `patch(schemas)` may adjust a copy first."""
    import copy

    import jsonschema

    def convert(node):
        if isinstance(node, list):
            return [convert(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {k: convert(v) for k, v in node.items() if k != "nullable"}
        return {"anyOf": [out, {"type": "null"}]} if node.get("nullable") else out

    components = convert(copy.deepcopy(OPENAI_SCHEMAS["components"]))
    if patch is not None:
        patch(components["schemas"])
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": components})


def _or_null(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _echoed_prompt_scores(schemas):
    """The document types a legacy choice's token_logprobs and top_logprobs items as never null; with echo, the
    API itself (and vLLM) sends null for the prompt's first token, which nothing predicts, and so do we."""
    lp = schemas["CreateCompletionResponse"]["properties"]["choices"]["items"]["properties"]["logprobs"]["anyOf"][0]
    for key in ("token_logprobs", "top_logprobs"):
        lp["properties"][key]["items"] = _or_null(lp["properties"][key]["items"])


def _streamed_legacy_choices(schemas):
    """The document describes streamed legacy completions with the response schema, whose finish_reason is never
    null; the API itself (and vLLM) sends null until a choice ends, and so do we."""
    _echoed_prompt_scores(schemas)
    choice = schemas["CreateCompletionResponse"]["properties"]["choices"]["items"]["properties"]
    choice["finish_reason"] = _or_null(choice["finish_reason"])


def test_responses_follow_openais_published_schema(service):
    """Every response and stream chunk of chat completions, completions and models validates against the schemas
    of OpenAI's OpenAPI document (tests/openai_schema, MIT): plain, streamed, n > 1, logprobs, usage, echo."""
    chat_schema = openai_validator("CreateChatCompletionResponse")
    chunk_schema = openai_validator("CreateChatCompletionStreamResponse")
    text_schema = openai_validator("CreateCompletionResponse", _echoed_prompt_scores)
    text_chunk_schema = openai_validator("CreateCompletionResponse", _streamed_legacy_choices)
    checked = 0

    def check(validator, obj):
        nonlocal checked
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
        assert not errors, (errors, obj)
        checked += 1

    openai_validator("ListModelsResponse").validate(httpx.get(f"{service}/v1/models").json())
    tools = {"tools": TOOLS, "max_tokens": 200, "seed": 2, "temperature": 1.0}
    for extra in ({}, {"n": 2, "seed": 3, "temperature": 1.0}, {"logprobs": True, "top_logprobs": 2},
                  dict(tools, tool_choice={"type": "function", "function": {"name": "add"}}, logprobs=True),
                  dict(tools, tool_choice="required", n=2), dict(tools, tool_choice="none", max_tokens=6),
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
                   "max_tokens": 120}):
        body = {"messages": user(), "max_tokens": 6, **extra}
        check(chat_schema, chat(service, body).json())
        stream = dict(body, stream=True, stream_options={"include_usage": True})
        with httpx.stream("POST", f"{service}/v1/chat/completions", json=stream, timeout=120) as r:
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            check(chunk_schema, event)
    for extra in ({}, {"logprobs": 2}, {"echo": True, "n": 2, "seed": 1}, {"prompt": [[5, 6], [7]]},
                  {"echo": True, "logprobs": 1, "n": 2}, {"echo": True, "logprobs": 0, "max_tokens": 0}):
        body = {"prompt": "hello", "max_tokens": 5, **extra}
        check(text_schema, httpx.post(f"{service}/v1/completions", json=body, timeout=120).json())
        with httpx.stream("POST", f"{service}/v1/completions", json=dict(body, stream=True), timeout=120) as r:
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            check(text_chunk_schema, event)
    assert checked > 60


def test_echo_with_logprobs_scores_the_prompt_as_an_uncached_forward(service):
    """/v1/completions with echo and logprobs (lm-eval's multiple-choice request, and max_tokens 0): the prompt's
    tokens as sent (not the <|bos|> put before them), their logprobs against one uncached forward of the model,
    the first null; the second choice of a question reuses the context from the prefix cache (its whole blocks,
    but the last position)."""
    model, tok, _ = load_chat_model(CHECKPOINTS["chat"], "cpu")
    context, choices = list(range(40, 90)), ([7, 8, 9], [10, 11])
    for i, cont in enumerate(choices):
        ids = context + cont
        body = {"prompt": ids, "max_tokens": 1 if i == 0 else 0, "echo": True, "logprobs": 2, "temperature": 0}
        r = httpx.post(f"{service}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        lp = out["choices"][0]["logprobs"]
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([[tok.bos_id] + ids]))[0].float(), -1)
        want = [None] + [ref[p, ids[p]].item() for p in range(1, len(ids))]    # position p + 1 after the <|bos|>
        got = lp["token_logprobs"][:len(ids)]
        assert got[0] is None and lp["top_logprobs"][0] is None
        assert all(abs(a - b) < 1e-4 for a, b in zip(got[1:], want[1:])), (got, want)
        assert len(lp["tokens"]) == len(ids) + (1 if i == 0 else 0)
        assert out["usage"]["completion_tokens"] == (1 if i == 0 else 0)
        if i:
            block = httpx.get(f"{service}/debug/stats").json()["chat"]["kv_cache"]["block_size"]
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == (1 + len(context)) // block * block - 1


LM_EVAL_TASK = """task: startlux_pick
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
LM_EVAL_DOCS = [
    {"question": "what is the capital of france?", "choices": [" paris", " a small city", " the river"], "answer": 0},
    {"question": "the cat sat on", "choices": [" a mat", " the red mountain", " blue"], "answer": 0},
    {"question": "how are you", "choices": [" hello", " small", " large country"], "answer": 1},
]


def test_lm_eval_multiple_choice_through_the_service(service, tmp_path, monkeypatch):
    """lm-evaluation-harness's own `local-completions` model runs a multiple-choice task of ours against the live
    service, with the tokenizer it loads from the checkpoint's tokenizer.json: every choice's summed continuation
    log-probability equals one uncached forward of the model over <|bos|> + context + continuation, to 1e-4."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in LM_EVAL_DOCS))
    (tmp_path / "task.yaml").write_text(LM_EVAL_TASK.format(data=data))
    checkpoint = CHECKPOINTS["chat"]
    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)    # not its thousands (9 s to index)
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=["startlux_pick"], task_manager=tasks,
        model_args=f"model=chat,base_url={service}/v1/completions,tokenizer_backend=huggingface,"
                   f"tokenizer={checkpoint},num_concurrent=1,max_retries=1,tokenized_requests=True",
        log_samples=True)
    model, tok, _ = load_chat_model(checkpoint, "cpu")
    samples = results["samples"]["startlux_pick"]
    assert len(samples) == len(LM_EVAL_DOCS)
    compared = 0
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            (got, _greedy), = resp                                   # each choice: [(loglikelihood, is_greedy)]
            ctx, cont = tok.encode(context), tok.encode(continuation)
            ids = [tok.bos_id] + ctx + cont
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([ids]))[0].float(), -1)
            want = sum(lp[len(ctx) + j, t].item() for j, t in enumerate(cont))
            assert abs(got - want) < 1e-4, (context, continuation, got, want)
            compared += 1
    assert compared == sum(len(d["choices"]) for d in LM_EVAL_DOCS)
    assert "acc,none" in results["results"]["startlux_pick"]


# ---- structured outputs and tool calls over HTTP
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2}},
          "required": ["name", "age", "pets"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather in a city", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                              "unit": {"enum": ["c", "f"]}},
             "required": ["city", "unit"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["a", "b"], "additionalProperties": False}}}]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def streamed_choices(url, route, body):
    """A streamed response gathered per choice: content text, tool calls (by index, arguments joined), finish."""
    with httpx.stream("POST", f"{url}{route}", json=dict(body, stream=True), timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    out = {}
    for ev in events[:-1]:
        for c in ev["choices"]:
            o = out.setdefault(c["index"], {"content": "", "calls": {}, "finish": None})
            delta = c.get("delta", {})
            o["content"] += delta.get("content") or c.get("text") or ""
            for d in delta.get("tool_calls") or []:
                call = o["calls"].setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
                if "id" in d:
                    assert call["id"] is None and d["type"] == "function"     # id and name come once, first
                    call["id"], call["name"] = d["id"], d["function"]["name"]
                call["arguments"] += d["function"]["arguments"]
            o["finish"] = c["finish_reason"] or o["finish"]
    return out


def test_json_schema_response_format_streamed_and_not(service):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    body = {"messages": user("describe a person"), "max_tokens": 120, "temperature": 1.0, "seed": 4, "n": 2,
            "response_format": fmt}
    whole = chat(service, body).json()
    streamed = streamed_choices(service, "/v1/chat/completions", body)
    for c in whole["choices"]:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["message"]["content"]), PERSON)
        assert streamed[c["index"]]["content"] == c["message"]["content"]
    assert whole["choices"][0]["message"]["content"] != whole["choices"][1]["message"]["content"]
    # raw completions take a response_format too; a length cut says so
    text = httpx.post(f"{service}/v1/completions", json={"prompt": "a person:", "max_tokens": 120, "seed": 1,
                                                          "temperature": 1.0, "response_format": fmt}, timeout=120).json()
    jsonschema.validate(json.loads(text["choices"][0]["text"]), PERSON)
    cut = chat(service, dict(body, max_tokens=4, n=1)).json()["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"].startswith("{")


@pytest.mark.parametrize("fmt,param,needle", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}},
     "response_format.json_schema.schema", "uniqueItems"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "bogus"}}},
     "response_format.json_schema.schema", "bogus"),
    ({"type": "grammar"}, "response_format", "json_schema"),
])
def test_an_unenforceable_response_format_is_a_400_naming_it(service, fmt, param, needle):
    r = chat(service, {"messages": user(), "response_format": fmt})
    assert r.status_code == 400 and r.json()["error"]["param"] == param and needle in r.json()["error"]["message"]


def test_vllm_structured_outputs_on_chat_and_completions(service):
    """vLLM's structured_outputs body field (what its clients send in extra_body): a choice, a regex and a Lark
    grammar constrain chat and raw completions, streamed like any text; what cannot be enforced is a 400 naming
    the field."""
    import re

    cases = [({"choice": ["red", "green", "blue"]}, {"red", "green", "blue"}.__contains__),
             ({"regex": r"[0-9]{3}-[a-z]{2,4}"}, re.compile(r"[0-9]{3}-[a-z]{2,4}").fullmatch),
             ({"grammar": 'start: "n=" NUM ("," NUM){0,2}\nNUM: /[0-9]{1,2}/'},
              re.compile(r"n=[0-9]{1,2}(,[0-9]{1,2}){0,2}").fullmatch)]
    for spec, check in cases:
        body = {"messages": user("pick"), "max_tokens": 40, "temperature": 1.0, "seed": 3, "n": 2,
                "structured_outputs": spec}
        whole = chat(service, body).json()
        streamed = streamed_choices(service, "/v1/chat/completions", body)
        for c in whole["choices"]:
            assert c["finish_reason"] == "stop" and check(c["message"]["content"]), (spec, c)
            assert streamed[c["index"]]["content"] == c["message"]["content"]
        text = httpx.post(f"{service}/v1/completions", json={"prompt": "pick:", "max_tokens": 40, "temperature": 1.0,
                                                              "structured_outputs": spec}, timeout=120).json()
        assert check(text["choices"][0]["text"]), (spec, text)
    for bad, param, needle in [({"regex": "(?=a)b"}, "structured_outputs.regex", "look-around"),
                               ({"grammar": 'root ::= "a"'}, "structured_outputs.grammar", "Lark"),
                               ({"choice": ["a"], "regex": "b"}, "structured_outputs", "one of")]:
        r = chat(service, {"messages": user(), "structured_outputs": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert needle in r.json()["error"]["message"], r.text
    both = chat(service, {"messages": user(), "structured_outputs": {"choice": ["a"]},
                          "response_format": {"type": "json_object"}})
    assert both.status_code == 400 and "send one" in both.json()["error"]["message"]


def test_tokenize_and_detokenize_in_vllms_shapes(service, tokenizer):
    """/tokenize gives the checkpoint tokenizer's ids (after <|bos|> unless told not to) and, for messages, the
    prompt a chat request runs: as many tokens as that request's usage counts; /detokenize inverts it."""
    text = "hello how are you, 2+2?"
    r = httpx.post(f"{service}/tokenize", json={"prompt": text, "return_token_strs": True}, timeout=60).json()
    assert r["tokens"] == [tokenizer.bos_id] + tokenizer.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 8192 and "".join(r["token_strs"]) == "<|bos|>" + text
    bare = httpx.post(f"{service}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60).json()
    assert bare["tokens"] == r["tokens"][1:] and bare["token_strs"] is None
    back = httpx.post(f"{service}/detokenize", json={"tokens": bare["tokens"]}, timeout=60).json()
    assert back == {"prompt": text}
    for body in ({"messages": user(text)}, {"messages": user(text), "tools": TOOLS}):
        counted = httpx.post(f"{service}/tokenize", json=body, timeout=60).json()
        ran = chat(service, dict(body, max_tokens=1, **({"tool_choice": "none"} if "tools" in body else {}))).json()
        assert counted["count"] == ran["usage"]["prompt_tokens"], (counted, ran["usage"])
        open_turn = httpx.post(f"{service}/tokenize", json=dict(body, add_generation_prompt=False), timeout=60).json()
        assert open_turn["tokens"] == counted["tokens"][:-1]
    for path, body, param in [("/tokenize", {"prompt": "a", "messages": user()}, None),
                              ("/tokenize", {"messages": [{"role": "assistant", "content": "x"}]}, "messages"),
                              ("/tokenize", {"messages": user(), "continue_final_message": True}, None),
                              ("/tokenize", {"prompt": "x" * 3000}, "prompt"),
                              ("/tokenize", {"prompt": "a", "model": "nope"}, "model"),
                              ("/detokenize", {"tokens": [10 ** 6]}, "tokens"),
                              ("/detokenize", {"tokens": [-1]}, "tokens")]:
        bad = httpx.post(f"{service}{path}", json=body, timeout=60)
        assert bad.status_code in (400, 404) and (param is None or bad.json()["error"]["param"] == param), bad.text
    assert httpx.post(f"{service}/keyed/tokenize", json={"prompt": "a"}, timeout=60).status_code == 401
    spec = httpx.get(f"{service}/openapi.json", timeout=60).json()
    assert {"/tokenize", "/detokenize"} <= set(spec["paths"])


def test_tool_calls_named_and_required_streamed_and_not(service):
    import jsonschema

    named = {"messages": user("weather in paris?"), "tools": TOOLS, "max_tokens": 100, "temperature": 1.0, "seed": 2,
             "tool_choice": {"type": "function", "function": {"name": "weather"}}}
    required = dict(named, tool_choice="required", n=2, max_tokens=200)
    for body in (named, required):
        whole = chat(service, body).json()
        streamed = streamed_choices(service, "/v1/chat/completions", body)
        for c in whole["choices"]:
            msg = c["message"]
            assert c["finish_reason"] == "tool_calls" and msg["content"] is None and msg["tool_calls"], c
            for call in msg["tool_calls"]:
                assert call["type"] == "function" and call["id"].startswith("call_")
                jsonschema.validate(json.loads(call["function"]["arguments"]), TOOL_SCHEMAS[call["function"]["name"]])
            got = streamed[c["index"]]
            assert got["finish"] == "tool_calls" and got["content"] == ""
            assert [(x["name"], x["arguments"]) for x in got["calls"].values()] == \
                [(x["function"]["name"], x["function"]["arguments"]) for x in msg["tool_calls"]]
        if body is named:
            assert [x["function"]["name"] for x in whole["choices"][0]["message"]["tool_calls"]] == ["weather"]
    # a stop string that cuts the arguments short ends the reply as "stop", with the calls as far as they got
    stopped = chat(service, dict(named, stop=['"'])).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["message"]["tool_calls"][0]["function"]["arguments"] == "{"
    # text instead of calls with "none"; "auto" (the default) is refused with what to send
    none = chat(service, dict(named, tool_choice="none", max_tokens=5)).json()["choices"][0]
    assert none["finish_reason"] == "length" and isinstance(none["message"]["content"], str)
    assert "tool_calls" not in none["message"]
    for choice in ("auto", None):
        r = chat(service, {k: v for k, v in dict(named, tool_choice=choice).items() if v is not None})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert '"required"' in r.json()["error"]["message"]


def test_an_agent_loop_sends_calls_and_results_back(service):
    """The OpenAI SDK's agent loop: a forced call, its result sent back as a tool message, then a text answer."""
    _, client = openai_client(service)
    messages = user("weather in paris?")
    first = client.chat.completions.create(model="chat", messages=messages, tools=TOOLS, max_tokens=100,
                                           tool_choice={"type": "function", "function": {"name": "weather"}})
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "weather"
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model="chat", messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=6)
    assert second.choices[0].message.content and second.choices[0].finish_reason == "length"
    r = chat(service, {"messages": user() + [{"role": "tool", "content": "x"}]})
    assert r.status_code == 400 and "tool_call_id" in r.json()["error"]["message"]


def test_langchain_with_structured_output_in_all_three_methods(service):
    """LangChain's ChatOpenAI.with_structured_output, unmodified, in its three methods: json_schema and
    function_calling parse into the pydantic model; json_mode parses the JSON content (a bias on "}" makes the
    random model close its object at once, so the test does not wait on its choice of keys)."""
    pytest.importorskip("langchain_openai")
    from typing import Literal

    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=10)
        age: int = Field(ge=0, le=99)
        pet: Literal["cat", "dog"]

    llm = ChatOpenAI(base_url=f"{service}/v1", api_key="unused", model="chat", max_tokens=100, temperature=1.0,
                     seed=3, max_retries=0)
    for method in ("json_schema", "function_calling"):
        got = llm.with_structured_output(Person, method=method, strict=True).invoke("describe a person")
        assert isinstance(got, Person), (method, got)
    close = load_chat_tokenizer(CHECKPOINTS["chat"])[0].encode("}")
    assert len(close) == 1
    got = llm.bind(logit_bias={close[0]: 100}).with_structured_output({"title": "anything", "type": "object"}, method="json_mode").invoke(
        "return a JSON object")
    assert got == {}


# ---- the Responses API
def response_validators():
    """OpenAI's Response and ResponseStreamEvent schemas. The document's FunctionTool requires `strict`, which it
    types as a nullable boolean, and its output items' `status`; nothing is patched."""
    return openai_validator("Response"), openai_validator("ResponseStreamEvent")


def errors_of(validator, obj) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"[:300] for e in validator.iter_errors(obj)]


def responses_stream(url, body) -> list[dict]:
    """The events of a streamed /v1/responses call, with each SSE `event:` line checked against its data's type."""
    events, kind = [], None
    with httpx.stream("POST", f"{url}/v1/responses", json=dict(body, stream=True), timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                ev = json.loads(line[6:])
                assert ev["type"] == kind, (kind, ev)
                events.append(ev)
    return events


def test_the_responses_api_plain_streamed_and_with_tools(service):
    """/v1/responses, stateless: a plain answer, the same streamed (the event sequence of OpenAI's API, in order,
    its text the response's), a forced function call and its output sent back as input; every response and event
    validates against OpenAI's published schemas."""
    response_schema, event_schema = response_validators()
    body = {"input": "hello how are you", "instructions": "be brief", "max_output_tokens": 6, "temperature": 1.0}
    whole = httpx.post(f"{service}/v1/responses", json=body, timeout=120).json()
    assert not errors_of(response_schema, whole), errors_of(response_schema, whole)
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    [msg] = whole["output"]
    assert msg["type"] == "message" and msg["role"] == "assistant" and msg["content"][0]["text"]
    assert whole["usage"]["output_tokens"] == 6 and whole["usage"]["input_tokens"] > 5

    events = responses_stream(service, body)
    for ev in events:
        assert not errors_of(event_schema, ev), (errors_of(event_schema, ev), ev)
    assert [ev["sequence_number"] for ev in events] == list(range(len(events)))
    kinds = [ev["type"] for ev in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"], kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"], kinds
    final = events[-1]["response"]
    text = "".join(ev["delta"] for ev in events if ev["type"] == "response.output_text.delta")
    assert text == final["output"][0]["content"][0]["text"] == events[-4]["text"] and final["usage"]["output_tokens"] == 6

    tools = [{"type": "function", "name": t["function"]["name"], "description": t["function"].get("description"),
              "parameters": t["function"]["parameters"], "strict": True} for t in TOOLS]
    called = {"input": [{"role": "user", "content": "weather in paris?"}], "tools": tools, "max_output_tokens": 100,
              "tool_choice": {"type": "function", "name": "weather"}, "temperature": 1.0}
    import jsonschema

    for streamed in (False, True):
        if streamed:
            events = responses_stream(service, called)
            for ev in events:
                assert not errors_of(event_schema, ev), (errors_of(event_schema, ev), ev)
            out = events[-1]["response"]
            args = "".join(ev["delta"] for ev in events if ev["type"] == "response.function_call_arguments.delta")
            assert args == out["output"][0]["arguments"]
            assert "response.function_call_arguments.done" in [ev["type"] for ev in events]
        else:
            out = httpx.post(f"{service}/v1/responses", json=called, timeout=120).json()
        assert not errors_of(response_schema, out), errors_of(response_schema, out)
        assert out["status"] == "completed", out
        [call] = out["output"]
        assert call["type"] == "function_call" and call["name"] == "weather" and call["call_id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), TOOL_SCHEMAS["weather"])
    back = dict(called, tool_choice="none", max_output_tokens=4,
                input=called["input"] + [call, {"type": "function_call_output", "call_id": call["call_id"],
                                                "output": "sunny, 21 C"}])
    answered = httpx.post(f"{service}/v1/responses", json=back, timeout=120).json()
    assert answered["output"][0]["type"] == "message" and answered["usage"]["input_tokens"] > out["usage"]["input_tokens"]


@pytest.mark.parametrize("body,param,needle", [
    ({"store": True}, None, "store"), ({"previous_response_id": "resp_1"}, None, "previous_response_id"),
    ({"conversation": "conv_1"}, None, "conversation"), ({"background": True}, None, "background"),
    ({"reasoning": {"effort": "high"}}, None, "reasoning"), ({"include": ["reasoning.encrypted_content"]}, None, "include"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "reasoning"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     "input_image"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format", "grammar"),
    ({"temperature": 3}, "temperature", "must be in [0, 2]"),
    ({"some_new_knob": 1}, None, "some_new_knob"),
])
def test_what_the_responses_api_cannot_do_is_a_400_naming_it(service, body, param, needle):
    r = httpx.post(f"{service}/v1/responses", json={"input": "hello", **body}, timeout=60)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert param is None or r.json()["error"]["param"] == param, r.text


def test_the_openai_sdk_and_agents_sdk_speak_responses(service):
    """The OpenAI SDK's client.responses.create, plain, streamed and with a tool, unmodified; then the OpenAI Agents
    SDK running an agent whose tool is a Python function (tool_choice "required" and stop at the first tool: this
    random model has no tool-call format of its own, so it cannot choose; the demo model's agents are in
    tests/test_agents.py)."""
    import asyncio
    from typing import Literal

    from openai import AsyncOpenAI

    _, client = openai_client(service)
    r = client.responses.create(model="chat", input="hello", max_output_tokens=5)
    assert r.status == "incomplete" and r.output_text and r.usage.output_tokens == 5
    with client.responses.stream(model="chat", input="hello", max_output_tokens=5) as stream:
        events = list(stream)
    # cut by max_output_tokens, the stream ends with response.incomplete, as OpenAI's does (the SDK's
    # get_final_response takes only a completed one)
    deltas = [ev.delta for ev in events if ev.type == "response.output_text.delta"]
    assert events[-1].type == "response.incomplete" and "".join(deltas) == events[-1].response.output_text
    tools = [{"type": "function", "name": "weather", "parameters": TOOL_SCHEMAS["weather"], "strict": True}]
    called = client.responses.create(model="chat", input="weather in paris?", tools=tools, tool_choice="required",
                                     max_output_tokens=100)
    assert called.output[0].type == "function_call" and called.output[0].name == "weather"

    agents = pytest.importorskip("agents")
    seen = []

    @agents.function_tool
    def weather(city: Literal["paris", "rome", "oslo"]) -> str:      # an enum: a random model's string may not end
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    async def run():
        model = agents.OpenAIResponsesModel(model="chat", openai_client=AsyncOpenAI(base_url=f"{service}/v1",
                                                                                   api_key="unused"))
        agent = agents.Agent(name="forecaster", instructions="answer with the weather", model=model, tools=[weather],
                             tool_use_behavior="stop_on_first_tool",
                             model_settings=agents.ModelSettings(tool_choice="required", max_tokens=60))
        return await agents.Runner.run(agent, "weather in paris?")

    agents.set_tracing_disabled(True)
    result = asyncio.run(run())
    assert len(seen) == 1 and result.final_output == f"sunny in {seen[0]}"
