"""Several models in one service: the `models:` list, each model its own deployment, the Ingress's registry, and
models added and replaced while others serve."""
import threading

import httpx
import pytest
import torch

from core.chat import LLMEngine, SamplingParams, load_chat_model, save_chat_model
from deployments.settings import AppArgs
from tests.conftest import delete_apps, tiny_model
from tests.decision_fixtures import build_checkpoint
from tests.test_chat_engine import collect
from tests.waiting import wait_until

# ---- the settings


def test_models_take_their_kind_s_flat_settings_as_defaults():
    a = AppArgs.model_validate({
        "device": "cpu", "chat_max_rows": 8, "chat_dtype": "float32", "decision_max_length": 900,
        "models": [
            {"kind": "chat", "name": "small", "checkpoint": "/m/small", "max_rows": 4,
             "deployment": {"num_replicas": 2}},
            {"kind": "chat", "checkpoint": "/m/big", "aliases": ["big-latest"], "engine": {"prefill_chunk": 64}},
            {"kind": "decision", "name": "judge", "checkpoint": "/m/judge"},
            {"kind": "decision", "name": "judge-2", "aliases": ["judge-next"], "max_length": 100}]})
    small, big, judge, judge2 = a.served_models()
    assert [m.deployment_name for m in a.served_models()] == ["small", "big", "judge", "judge-2"]
    assert (small.settings.engine.max_rows, big.settings.engine.max_rows) == (4, 8)      # own, else the flat key
    assert small.settings.engine.dtype == big.settings.engine.dtype == "float32"
    assert big.settings.engine.prefill_chunk == 64 and big.names == ["big", "big-latest"]
    assert small.deployment == {"num_replicas": 2} and big.deployment == {}
    assert (judge.settings.scorer.max_length, judge2.settings.scorer.max_length) == (900, 100)
    assert judge2.names == ["judge-2", "judge-next"] and judge.settings.device == "cpu"
    # without `models:`, one of each kind in the deployments the single-model configs name
    assert [(m.kind, m.deployment_name) for m in AppArgs().served_models()] == [("chat", "ChatModel"),
                                                                                 ("decision", "DecisionModel")]


@pytest.mark.parametrize("models,message", [
    ([{"kind": "chat", "name": "x"}, {"kind": "decision", "name": "x"}], "two models answer to 'x'"),
    ([{"kind": "chat", "name": "x", "aliases": ["y"]}, {"kind": "chat", "name": "y"}], "two models answer to 'y'"),
    ([{"name": "x"}], "kind: chat"),
    ([{"kind": "chat", "max_rowz": 3}], "max_rowz"),
    ([{"kind": "chat", "deployment": [1]}], "Serve options"),
    ([], "at least one model"),
])
def test_a_bad_models_list_is_refused_naming_the_problem(models, message):
    with pytest.raises(ValueError, match=message):
        AppArgs.model_validate({"models": models})


# ---- the service

# graceful_shutdown_timeout_s as the shipped configs have it (more than a replica's start on a busy host): in a
# redeploy each one-replica deployment has a moment with no replica, and a request that the old Ingress holds
# waits there for the model's new replica
SMALL = {"ray_actor_options": {"num_cpus": 0.1}, "max_ongoing_requests": 32, "graceful_shutdown_timeout_s": 120}
PROMPT = list(range(40, 60))


def endless(arch, tokenizer, seed, path):
    """A tiny chat model that never ends a reply on its own, saved at `path`."""
    model = tiny_model(arch, tokenizer, seed=seed, std=0.3, sequence_len=4096)
    with torch.no_grad():
        model.lm_head.weight[min(tokenizer.special_tokens.values()):] = 0.0
    save_chat_model(str(path), model, tokenizer)
    return str(path)


def greedy(checkpoint, n=12):
    """The checkpoint's greedy text for PROMPT, from an engine in this process (fp32)."""
    model, tok, _ = load_chat_model(checkpoint, "cpu")
    engine = LLMEngine(model, tok, max_rows=2, process=False)
    engine.add_request([tok.bos_id] + PROMPT, SamplingParams(max_tokens=n, temperature=0), "r")
    return tok.decode(collect(engine)["r"][0])


def complete(url, model, n=12):
    """/v1/completions of PROMPT, greedy, by the model named (None: none named) -> the response."""
    body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0}
    if model is not None:
        body["model"] = model
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def models_args(checkpoints, extra=()):
    entries = [{"kind": "chat", "name": "nano", "checkpoint": checkpoints["nano"], "deployment": SMALL},
               {"kind": "chat", "name": "gpt2", "aliases": ["gpt2-latest"], "checkpoint": checkpoints["gpt2"],
                "deployment": SMALL},
               {"kind": "decision", "name": "judge", "checkpoint": checkpoints["judge"], "deployment": SMALL},
               {"kind": "decision", "name": "judge-2", "aliases": ["judge-next"], "checkpoint": checkpoints["judge2"],
                "deployment": SMALL}, *extra]
    return AppArgs.model_validate({"device": "cpu", "chat_dtype": "float32", "chat_max_rows": 4,
                                   "decision_process": False, "models": entries})


@pytest.fixture(scope="module")
def multi(serve_url, tmp_path_factory, tokenizer):
    from ray import serve

    from deployments.app import wire

    root = tmp_path_factory.mktemp("models")
    checkpoints = {"nano": endless("modern", tokenizer, 1, root / "nano"),
                   "gpt2": endless("gpt2", tokenizer, 2, root / "gpt2"),
                   "other": endless("nanochat", tokenizer, 3, root / "other"),
                   "judge": build_checkpoint(str(root / "judge"), seed=0),
                   "judge2": build_checkpoint(str(root / "judge2"), seed=1)}
    serve.run(wire(models_args(checkpoints), {"Ingress": SMALL}), name="multi", route_prefix="/multi")
    yield serve_url + "/multi", checkpoints
    delete_apps("multi")


@pytest.mark.serve
def test_every_model_is_listed_healthy_and_answers_by_its_names(multi):
    url, checkpoints = multi
    cards = httpx.get(f"{url}/v1/models").json()["data"]
    assert [(c["id"], c["kind"], c.get("alias_of")) for c in cards] == [
        ("nano", "chat", None), ("gpt2", "chat", None), ("gpt2-latest", "chat", "gpt2"),
        ("judge", "decision", None), ("judge-2", "decision", None), ("judge-next", "decision", "judge-2")]
    health = httpx.get(f"{url}/healthz")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "models": {n: "ok" for n in ("nano", "gpt2", "judge", "judge-2")}}
    # each chat model generates its own checkpoint's tokens; no `model`: the first chat model
    for name, ckpt in (("nano", "nano"), ("gpt2", "gpt2"), ("gpt2-latest", "gpt2"), (None, "nano")):
        out = complete(url, name)
        assert out["model"] == ("nano" if name is None else name.removesuffix("-latest"))
        assert out["choices"][0]["text"] == greedy(checkpoints[ckpt]), name
    assert greedy(checkpoints["nano"]) != greedy(checkpoints["gpt2"])
    # an unknown name, or a model of the other kind, is a 404 naming the served ones
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "model": "judge"}, timeout=60)
    assert r.status_code == 404 and "'nano', 'gpt2', 'gpt2-latest'" in r.json()["error"]["message"]
    # decisions go to the model named; each model's own counters say so
    body = {"state": "the cat is red", "questions": {"c": {"question": "which color",
                                                           "criteria": {"r": "red", "b": "blue"}}}}
    before = httpx.get(f"{url}/debug/stats").json()["models"]
    answers = {}
    for name in ("judge-next", "judge-next", "judge"):
        r = httpx.post(f"{url}/v1/systemone", json=dict(body, model=name), timeout=60)
        assert r.status_code == 200, r.text
        answers[name] = r.json()["answers"]["c"]["probabilities"]
    after = httpx.get(f"{url}/debug/stats").json()["models"]
    assert after["judge-2"]["batches"] - before["judge-2"]["batches"] == 2
    assert after["judge"]["batches"] - before["judge"]["batches"] == 1
    assert answers["judge"] != answers["judge-next"]          # two checkpoints
    r = httpx.post(f"{url}/v1/systemone", json=dict(body, model="nano"), timeout=60)
    assert r.status_code == 404 and "'judge', 'judge-2', 'judge-next'" in r.json()["error"]["message"]
    assert set(after) == {"nano", "gpt2", "judge", "judge-2"} and after["nano"]["kind"] == "chat"


@pytest.mark.serve
def test_a_model_added_and_replaced_while_another_streams(multi):
    """A config that adds a chat model, then one that points it at another checkpoint, deployed while a stream of
    another model runs: that stream and every request beside it complete, and the added model answers with its
    new checkpoint's tokens once the update is done."""
    from ray import serve

    from deployments.app import wire

    url, checkpoints = multi
    failures, done = [], threading.Event()

    def stream_nano():
        while not done.is_set():
            body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True, "model": "nano"}
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                    text = list(r.iter_lines())
                lines = [line for line in text if line.startswith("data: ")]
                if r.status_code != 200 or not lines or lines[-1] != "data: [DONE]" or len(lines) < 10:
                    failures.append((r.status_code, text[-2:]))
            except httpx.HTTPError as e:
                failures.append(repr(e))

    client = threading.Thread(target=stream_nano)
    client.start()
    try:
        for ckpt in ("gpt2", "other"):          # added (a copy of gpt2's checkpoint), then replaced
            added = {"kind": "chat", "name": "added", "checkpoint": checkpoints[ckpt], "deployment": SMALL}
            serve.run(wire(models_args(checkpoints, [added]), {"Ingress": SMALL}), name="multi",
                      route_prefix="/multi")
            assert complete(url, "added")["choices"][0]["text"] == greedy(checkpoints[ckpt]), ckpt
            assert complete(url, "nano")["model"] == "nano"
    finally:
        done.set()
        client.join(timeout=300)
    assert not failures, failures


@pytest.mark.serve
def test_the_example_config_serves_four_models(tmp_path):
    """`startlux serve serve_config.models.yaml`: the nanochat and GPT-2 demo chat models and the decision model
    under two names, each answering; stopped as Ctrl-C stops it, nothing left behind."""
    from tests.readme_service import ReadmeService

    svc = ReadmeService(tmp_path, config="serve_config.models.yaml")
    try:
        svc.start(timeout=300)
        url = svc.url
        health = httpx.get(f"{url}/healthz", timeout=30).json()
        assert health == {"status": "ok", "models": {n: "ok" for n in (
            "demo-chat", "demo-gpt2", "startlux-decision", "startlux-decision-whole")}}
        ids = [(c["id"], c["kind"]) for c in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
        assert ids == [("demo-chat", "chat"), ("demo-gpt2", "chat"), ("gpt2", "chat"), ("startlux-decision", "decision"),
                       ("startlux-decision-whole", "decision")]
        for model in ("demo-chat", "gpt2"):
            r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": model, "messages": [{"role": "user", "content": "what is the capital of Belgium"}]})
            assert r.status_code == 200 and "Brussels" in r.json()["choices"][0]["message"]["content"], r.text
            assert r.json()["model"] == ("demo-gpt2" if model == "gpt2" else model)
        body = {"state": "apples: 3, pears: 5", "questions": {"most": {
            "question": "which fruit is there most of", "criteria": {"a": "apples", "p": "pears"}}}}
        answers = [httpx.post(f"{url}/v1/systemone", json=dict(body, model=m), timeout=120).json()
                   for m in ("startlux-decision", "startlux-decision-whole")]
        assert [a["model"] for a in answers] == ["startlux-decision", "startlux-decision-whole"]
        a, b = (x["answers"]["most"]["probabilities"] for x in answers)     # one checkpoint, two paths
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-3 for k in a), (a, b)
    finally:
        svc.stop()
        left = svc.wait_gone(120)
    assert not left, (left, svc.stuck)


@pytest.mark.serve
def test_each_chat_model_has_its_own_admission(multi):
    """max_chat_inflight 1 and no waiting place: a stream of one chat model takes that model's slot, so another
    request for it is refused (503), while the other chat model still answers."""
    from ray import serve

    from deployments.app import wire

    url, checkpoints = multi
    entries = [{"kind": "chat", "name": n, "checkpoint": checkpoints[n], "deployment": SMALL} for n in ("nano", "gpt2")]
    args = AppArgs.model_validate({"device": "cpu", "chat_dtype": "float32", "chat_max_rows": 4,
                                   "max_chat_inflight": 1, "max_chat_waiting": 0, "models": entries})
    serve.run(wire(args, {"Ingress": SMALL}), name="admit", route_prefix="/admit")
    base = url.removesuffix("/multi") + "/admit"
    try:
        body = {"prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "stream": True, "model": "nano"}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))        # nano's slot is taken
            stats = httpx.get(f"{base}/debug/stats", timeout=30).json()
            assert stats["models"]["nano"]["admission"] == {"in_flight": 1, "waiting": 0}
            assert stats["models"]["gpt2"]["admission"] == {"in_flight": 0, "waiting": 0}
            busy = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "model": "nano"},
                              timeout=60)
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "overloaded"
            assert complete(base, "gpt2", n=4)["model"] == "gpt2"
        wait_until(lambda: httpx.get(f"{base}/debug/stats", timeout=30).json()["ingress"]["chat_in_flight"] == 0, 60,
                   "the stream's slot was not given back", 0.2)
        assert complete(base, "nano", n=4)["model"] == "nano"
    finally:
        delete_apps("admit")


@pytest.mark.serve
def test_a_model_served_with_int8_weights_answers_as_its_engine_does(serve_url):
    """`chat_weights: int8` through the service: the demo chat model's replica runs its linear layers in int8
    (/debug/stats), and chat completions from several clients at once, their prompts built by the chat template
    (few-shot priming, the calculator), get what an int8 engine in this process answers to the same messages."""
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from ray import serve

    from core.chat import ChatPrompter, load_chat_defaults
    from deployments.app import wire
    from tools.demo_heldout import _run

    demo = str(Path(__file__).resolve().parent.parent / "models" / "demo-chat")
    args = AppArgs.model_validate({"device": "cpu", "chat_dtype": "float32", "chat_max_rows": 8, "chat_weights": "int8",
                                   "models": [{"kind": "chat", "name": "demo-int8", "checkpoint": demo,
                                               "deployment": SMALL}]})
    serve.run(wire(args, {"Ingress": SMALL}), name="int8", route_prefix="/int8")
    base = serve_url + "/int8"
    questions = ["What is the capital of Peru?", "What is 17*23?", "Subtract 19 from 100.", "Hello",
                 "what is 250 divided by 4", "Capital of Japan?"]
    try:
        assert httpx.get(f"{base}/debug/stats", timeout=30).json()["chat"]["linear"] == "int8"

        def ask(q):
            r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": q}], "max_tokens": 32, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        with ThreadPoolExecutor(len(questions)) as pool:
            served = list(pool.map(ask, questions))
    finally:
        delete_apps("int8")
    model, tok, cfg = load_chat_model(demo, "cpu")
    defaults = load_chat_defaults(demo)
    prompter = ChatPrompter(tok, cfg.sequence_len, defaults.fewshot, defaults.tool_format)
    engine = LLMEngine(model, tok, max_rows=8, prefix_ids=prompter.prefix_ids, weights="int8", process=False)
    alone = _run(engine, {i: (prompter.render([{"role": "user", "content": q}], 32).ids,
                              SamplingParams(max_tokens=32, temperature=0.0)) for i, q in enumerate(questions)})
    assert served == [alone[i]["text"] for i in range(len(questions))]
    assert "Lima" in served[0] and "391" in served[1]
