"""The StartLux-Decision scorer on tiny random hybrid checkpoints (Qwen3.5 text: Gated DeltaNet + full attention)."""
import json
import os
import threading

import pytest
import torch

from core.decision import DecisionValidationError, StartLuxDecision, jevfmt as J
from core.decision.kernels import _chosen_implementation, linear_attention_kernels
from core.decision.graphs import fill_static, graph_shapes, pick_graph
from core.decision.scorer import padded_length
from tests.decision_fixtures import build_checkpoint
from tests.systemone_requests import REQUESTS, check_answers

TEMPS = {"choice": 1.0, "noul": 2.0, "score": 0.5}


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    return build_checkpoint(str(tmp_path_factory.mktemp("decision")), temperature_by_type=TEMPS)


@pytest.fixture(scope="session")
def scorer(ckpt):
    return StartLuxDecision(ckpt, device="cpu")


def color_q(n=3, extra=""):
    names = ["red", "blue", "green", "pear", "plum", "apple"][:n]
    return {"question": "which color is the cat" + extra, "criteria": {f"o{i}": v for i, v in enumerate(names)}}


def reference_probs(scorer, state, question):
    """Independent reference: render with jevfmt, run the full transformers model unpadded, softmax over letters."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(scorer.path).eval()
    row = J.from_systemone(state, question)
    ids, _ = J.render_ids(row, scorer.tok, [o.id for o in row.options], 10_000)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    z = logits[torch.tensor(scorer.letters[:len(row.options)])] / TEMPS[row.type]
    return torch.softmax(z, -1).tolist(), len(ids)


def test_matches_transformers_reference(scorer):
    state = "the cat is red and the dog is blue"
    qs = {"a": color_q(3), "b": {"type": "noul", "question": "is the cat red"},
          "c": {"type": "score", "question": "how red", "criteria": ["none", "some", "very", "all"]}}
    answers, usage = scorer.decide(state, qs)
    total = 0
    for key, q in qs.items():
        ref, n = reference_probs(scorer, state, q)
        total += n
        a = answers[key]
        if a["type"] == "choice":
            got = list(a["probabilities"].values())
        elif a["type"] == "noul":
            got = [a["noul"], None]
            ref = [ref[0], None]
        else:
            got = list(a["probabilities"].values())
            assert a["score"] == pytest.approx(sum(i * p for i, p in enumerate(ref)), abs=1e-4)
            assert a["confidence"] == pytest.approx(max(ref), abs=1e-4)
            assert a["legend"] == {"0": "none", "1": "some", "2": "very", "3": "all"}
        for g, r in zip(got, ref):
            if r is not None:
                assert g == pytest.approx(r, abs=1e-4)
    assert usage == {"input_tokens": total, "output_tokens": 0, "input_tokens_details": {"cached_tokens": 0}}
    assert list(answers) == ["a", "b", "c"]


def test_padding_invariance(scorer):
    short = {"q": color_q(2)}
    alone, _ = scorer.decide("red cat", short)
    long_state = "the dog is blue " * 60
    batch = scorer.decide_batch([("red cat", short), (long_state, {"x": color_q(4), "y": color_q(5)})])
    for k in ("o0", "o1"):
        assert batch[0]["q"]["probabilities"][k] == pytest.approx(alone["q"]["probabilities"][k], abs=1e-4)


def test_decide_batch_equals_decide_per_request(scorer):
    reqs = [("state one the cat", {"z": color_q(3), "a": {"type": "noul", "question": "is it"}}),
            ({"facts": ["cat red", "dog blue"], "n": 3}, {"m": color_q(4), "single": {"question": "q",
                                                                                    "criteria": {"only": "x"}}}),
            ("", {"s": {"type": "score", "question": "how many", "criteria": {"a": "0", "b": "1", "c": "2"}}})]
    batched = scorer.decide_batch(reqs, with_usage=True)
    for (state, qs), (answers, usage) in zip(reqs, batched):
        single, single_usage = scorer.decide(state, qs)
        assert list(answers) == list(qs)
        assert usage["input_tokens"] == single_usage["input_tokens"] and usage["output_tokens"] == 0
        for k in qs:
            for name, v in single[k].items():
                if isinstance(v, float):
                    assert answers[k][name] == pytest.approx(v, abs=1e-4)
                elif isinstance(v, dict) and name == "probabilities":
                    assert answers[k][name] == pytest.approx(v, abs=1e-4)
                else:
                    assert answers[k][name] == v


def test_single_option_uses_no_tokens(scorer):
    answers, usage = scorer.decide("s", {"k": {"question": "q", "criteria": {"only": "the one"}}})
    assert answers["k"] == {"type": "choice", "choice": "only", "confidence": 1.0, "probabilities": {"only": 1.0}}
    assert usage["input_tokens"] == 0


def test_temperature_by_type(ckpt, tmp_path, scorer):
    cfg = json.load(open(os.path.join(ckpt, "decision_config.json")))
    hot = tmp_path / "hot"
    import shutil
    shutil.copytree(ckpt, hot)
    cfg["temperature_by_type"]["choice"] = 3.0
    json.dump(cfg, open(hot / "decision_config.json", "w"))
    hot_scorer = StartLuxDecision(str(hot), device="cpu")
    q = {"q": color_q(3)}
    base = torch.tensor(list(scorer.decide("s", q)[0]["q"]["probabilities"].values()))
    hot_p = torch.tensor(list(hot_scorer.decide("s", q)[0]["q"]["probabilities"].values()))
    # p ∝ exp(z/T): log-probability differences scale by T_old/T_new
    assert (hot_p.log().diff()).numpy() == pytest.approx((base.log().diff() / 3.0).numpy(), abs=1e-4)


def test_tournament_over_60_options(scorer):
    criteria = {f"k{i}": f"option number {i} the {['red', 'blue', 'cat'][i % 3]}" for i in range(60)}
    answers, usage = scorer.decide("the cat", {"w": {"question": "which one", "criteria": criteria}})
    p = answers["w"]["probabilities"]
    assert list(p) == list(criteria) and sum(p.values()) == pytest.approx(1.0, abs=1e-6)
    # the seed's rule: 3 near-equal groups of 20, top 3 of each to the final; the rest share residual mass
    groups = scorer._groups(list(criteria))
    assert [len(g) for g in groups] == [20, 20, 20]
    first = scorer._probs(scorer.prepare(scorer.parse("the cat", {"w": {"question": "which one", "criteria": criteria}})).wide["w"], {})
    finalists = {k for g, ps in zip(groups, first) for k, _ in sorted(zip(g, ps), key=lambda x: -x[1])[:3]}
    rest_mass = sum(v for k, v in p.items() if k not in finalists)
    assert rest_mass == pytest.approx(scorer.residual, rel=1e-3)
    assert answers["w"]["choice"] in finalists
    assert usage["input_tokens"] > 0


def test_narrow_tournament_keeps_every_prompt_within_max_options(ckpt, tmp_path):
    import shutil
    narrow = tmp_path / "narrow"
    shutil.copytree(ckpt, narrow)
    cfg = json.load(open(narrow / "decision_config.json"))
    cfg["wide_choice"] = {"group": 6, "keep": 2, "residual": 1e-3, "max_options": 6}
    json.dump(cfg, open(narrow / "decision_config.json", "w"))
    s = StartLuxDecision(str(narrow), device="cpu")
    shown = []
    tail = s._tail
    s._tail = lambda row: shown.append(len(row.options)) or tail(row)
    criteria = {f"k{i}": f"option number {i}" for i in range(40)}
    answers, _ = s.decide("the cat", {"w": {"question": "which one", "criteria": criteria},
                                      "few": {"question": "which one", "criteria": {f"f{i}": str(i) for i in range(5)}}})
    p = answers["w"]["probabilities"]
    assert list(p) == list(criteria) and sum(p.values()) == pytest.approx(1.0, abs=1e-6)
    # 40 -> 7 groups of 5-6, top 2 each -> 14 finalists -> 3 groups -> 6 finalists -> one final prompt of 6
    assert max(shown) <= 6 and sorted(shown) == sorted([6] * 5 + [5] * 2 + [5, 5, 4] + [6] + [5])
    assert answers["w"]["choice"] == max(p, key=p.get)
    cfg["wide_choice"]["max_options"] = 4    # narrower than a group: refused at load
    json.dump(cfg, open(narrow / "decision_config.json", "w"))
    with pytest.raises(ValueError, match="max_options"):
        StartLuxDecision(str(narrow), device="cpu")


def test_validation_names_every_bad_question(scorer):
    calls = []
    original = scorer._letter_logits
    scorer._letter_logits = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        with pytest.raises(DecisionValidationError) as e:
            scorer.decide("s", {"good": color_q(2), "badtype": {"type": "vote", "question": "q"},
                                "empty": {"question": "q", "criteria": {}},
                                "both": {"type": "noul", "question": "q", "instructions": "q"},
                                "badnoul": {"type": "noul", "criteria": {"maybe": "x"}},
                                "badscore": {"type": "score", "question": "q", "criteria": ["one"]},
                                "malformed": {"question": "q", "criteria": ["a", "b"]}})
    finally:
        scorer._letter_logits = original
    assert set(e.value.errors) == {"badtype", "empty", "both", "badnoul", "badscore", "malformed"}
    assert "unknown type 'vote'" in e.value.errors["badtype"]
    assert "not both" in e.value.errors["both"]
    for key, kind in (("badnoul", "noul"), ("badscore", "score"), ("empty", "choice")):
        assert f"a {kind} question looks like" in e.value.errors[key]   # the reason and a valid example
    assert not calls, "nothing may be computed for a rejected request"
    with pytest.raises(DecisionValidationError, match="state"):
        scorer.decide({"x": float("nan")}, {"q": color_q(2)})
    with pytest.raises(DecisionValidationError, match="questions"):
        scorer.decide("s", {})


def test_long_state_is_cut_from_the_start(ckpt):
    small = StartLuxDecision(ckpt, device="cpu", max_length=120)
    state = " ".join(f"word{i}" for i in range(400)) + " FINAL"
    answers, usage = small.decide(state, {"q": color_q(3)})
    assert usage["input_tokens"] == 120
    row = J.from_systemone(state, color_q(3))
    ids, info = J.render_ids(row, small.tok, ["o0", "o1", "o2"], 120)
    text = small.tok.decode(ids)
    assert "FINAL" in text and "word0 " not in text and "[...]" in text and info.state_tokens_cut > 0
    assert text.endswith("Answer:") and "which color is the cat" in text
    with pytest.raises(DecisionValidationError, match="max_length"):
        small.decide("s", {"q": color_q(3, extra=" the dog" * 200)})


def test_check_tokenizer_and_config_mismatch(ckpt, tmp_path, scorer):
    import shutil

    assert J.check_tokenizer(scorer.tok) == scorer.letters and len(set(scorer.letters)) == 26
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    cfg = json.load(open(bad / "decision_config.json"))
    cfg["letter_token_ids"][0] += 1
    json.dump(cfg, open(bad / "decision_config.json", "w"))
    with pytest.raises(ValueError, match="letter_token_ids"):
        StartLuxDecision(str(bad), device="cpu")

    class CharTokenizer:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    with pytest.raises(J.FormatError, match="' A'.*' Z'"):
        J.check_tokenizer(CharTokenizer())
    # a template whose letters have no leading space makes them single characters: accepted
    assert len(J.check_tokenizer(CharTokenizer(), dict(J.DEFAULT_TEMPLATE, letter="{letter}"))) == 26


def test_template_from_decision_config(tmp_path):
    tpl = {"question": "Q: {question}\n", "answer": "A:"}
    path = build_checkpoint(str(tmp_path / "tpl"), template=tpl)
    s = StartLuxDecision(path, device="cpu")
    row = J.from_systemone("", color_q(2), s.template)
    ids, _ = J.render_ids(row, s.tok, ["o0", "o1"], 1000, s.template)
    assert s.tok.decode(ids).startswith("Q: which color") and s.tok.decode(ids).endswith("A:")


def test_multimodal_checkpoint_loads(tmp_path):
    path = build_checkpoint(str(tmp_path / "mm"), multimodal=True)
    s = StartLuxDecision(path, device="cpu")
    assert type(s.body).__name__ == "Qwen3_5TextModel"
    assert s.letter_rows.shape == (26, s.body.config.hidden_size)
    answers, _ = s.decide("s", {"q": color_q(3)})
    assert sum(answers["q"]["probabilities"].values()) == pytest.approx(1.0, abs=1e-5)


def test_concurrent_callers_get_consistent_answers(scorer):
    q = {"q": color_q(3)}
    expected = scorer.decide("s", q)[0]
    results, errors = [], []

    def worker():
        try:
            for _ in range(3):
                results.append(scorer.decide("s", q)[0])
        except Exception as e:   # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors and all(r == expected for r in results)


def test_graph_bookkeeping():
    shapes = graph_shapes()
    assert (1, 4096) in shapes and (4, 1024) in shapes and (4, 2048) not in shapes and (5, 128) not in shapes
    assert shapes[0][0] * shapes[0][1] == max(b * n for b, n in shapes)
    assert pick_graph([100], shapes) == (1, 128)
    assert pick_graph([100, 300, 129], shapes) == (3, 320)
    assert pick_graph([2000, 5], shapes) is None          # multi-row graphs stop at 1024 tokens
    assert pick_graph([5000], shapes) is None
    assert pick_graph([10] * 5, shapes) is None           # 5 questions: eager
    ids, last = torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    fill_static(ids, last, [[5, 6, 7], [9]], pad=0)
    assert ids.tolist() == [[5, 6, 7, 0, 0, 0, 0, 0], [9, 0, 0, 0, 0, 0, 0, 0]] and last.tolist() == [2, 0]
    assert padded_length(1) == 128 and padded_length(129) == 192 and padded_length(70000) == 73728


def test_graph_replay_writes_buffers_recorded_in_inference_mode():
    """Graphs are recorded in inference mode, so their static buffers are inference tensors; a replay called
    from plain code (the scorer's `decide`) must still fill them. A stand-in graph that copies ids to its output
    replaces the CUDA graph (recording needs CUDA)."""
    from core.decision.graphs import PromptGraphs

    with torch.inference_mode():
        ids, last, out = torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, dtype=torch.long), torch.zeros(2, 4)

    class Copying:
        def replay(self):
            out.copy_(ids.float())

    graphs = PromptGraphs.__new__(PromptGraphs)
    graphs.pad, graphs.graphs = 0, {(2, 4): (Copying(), ids, last, out)}
    got = graphs.replay((2, 4), [[3, 4], [5]])
    assert [g.tolist() for g in got] == [[3, 4, 0, 0], [5, 0, 0, 0]] and last.tolist() == [1, 0]


def test_kernel_detection_reads_transformers_choice(monkeypatch):
    import sys
    import types

    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    fake = types.ModuleType("fla")
    ops = types.ModuleType("fla.ops")
    gdr = types.ModuleType("fla.ops.gated_delta_rule")

    def chunk_gated_delta_rule(q, k, v):
        return "fast"

    chunk_gated_delta_rule.__module__ = "fla.ops.gated_delta_rule"
    gdr.chunk_gated_delta_rule = chunk_gated_delta_rule
    fake.ops, ops.gated_delta_rule = ops, gdr
    for name, mod in (("fla", fake), ("fla.ops", ops), ("fla.ops.gated_delta_rule", gdr)):
        monkeypatch.setitem(sys.modules, name, mod)

    @use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")
    def torch_chunk_gated_delta_rule(q, k, v):
        return "slow"

    name, impl = _chosen_implementation(torch_chunk_gated_delta_rule)
    assert name == "chunk_gated_delta_rule" and impl is chunk_gated_delta_rule
    # the real model module here has neither package: every kernel is on the torch path
    from transformers import Qwen3_5ForCausalLM
    assert set(linear_attention_kernels(Qwen3_5ForCausalLM).values()) == {"torch"}


def test_cuda_refuses_slow_kernels(ckpt, monkeypatch):
    from core.decision import SlowKernelsError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("STARTLUX_ALLOW_SLOW", raising=False)
    with pytest.raises(SlowKernelsError, match="flash-linear-attention"):
        StartLuxDecision(ckpt)


@pytest.mark.gpu
def test_cuda_graphs_match_eager(ckpt):
    s = StartLuxDecision(ckpt, device="cuda") if os.environ.get("STARTLUX_ALLOW_SLOW") == "1" or all(
        v != "torch" for v in linear_attention_kernels(__import__("transformers").Qwen3_5ForCausalLM).values()) \
        else pytest.skip("fast kernels not installed")
    assert s.graphs
    qs = {"a": color_q(3), "b": {"type": "noul", "question": "is it red"}}
    prompts = s.prepare(s.parse("the cat is red", qs)).prompts       # every option's probability, graph against eager
    graphed, eager = s._probs(prompts, {}), s._probs(prompts, {}, use_graphs=False)
    assert max(abs(a - b) for pg, pe in zip(graphed, eager) for a, b in zip(pg, pe)) < 2e-2
    graphed, _ = s.decide("the cat is red", qs)
    eager = s.decide_batch([("the cat is red", qs)])[0]
    assert graphed["a"]["choice"] == eager["a"]["choice"] or abs(
        graphed["a"]["confidence"] - eager["a"]["confidence"]) < 2e-2


# ---- the System One wire format as real clients send it

class CharTokenizer:
    """One token per character, so a rendered prompt reads back exactly."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def prompt_text(state, question, template=None):
    row = J.from_systemone(state, question, template)
    ids, _ = J.render_ids(row, CharTokenizer(), [o.id for o in row.options], 100_000, template)
    return CharTokenizer().decode(ids)


def test_prompts_of_each_wire_shape():
    assert prompt_text("s", {"instructions": "Which?", "criteria": {"a": "x", "b": None, "c": {"k": [1, 2]}}}) == (
        'State:\ns\n\nQuestion: Which?\nOptions:\nA. x\nB. b\nC. {"k": [1, 2]}\nAnswer:')
    assert prompt_text({"b": [1]}, {"type": "noul", "instructions": {"goal": "win", "rules": ["fair"]}}) == (
        'State:\n{\n  "b": [\n    1\n  ]\n}\n\nQuestion: {"goal": "win", "rules": ["fair"]}\nOptions:\nA. Yes\nB. No\nAnswer:')
    assert prompt_text("s", {"type": "noul", "criteria": {"true": "it is", "false": None}}) == (
        "State:\ns\n\nOptions:\nA. Yes: it is\nB. No\nAnswer:")
    assert prompt_text("", {"type": "score", "instructions": None, "criteria": ["low", {"level": 2}]}) == (
        'Options:\nA. 0: low\nB. 1: {"level": 2}\nAnswer:')
    # the older name renders exactly as `instructions` does, and extra keys change nothing
    assert prompt_text("s", {"question": "Q?", "criteria": {"a": "x", "b": "y"}}) == \
        prompt_text("s", {"instructions": "Q?", "criteria": {"a": "x", "b": "y"}, "proposition": "p"})
    # every new piece can be overridden by a checkpoint's template
    tpl = J.template_from({"template": {"no_question": "Pick:\n", "noul_option": "{label} ({text})"}})
    assert prompt_text("", {"type": "noul", "criteria": {"true": "t", "false": "f"}}, tpl) == (
        "Pick:\nA. Yes (t)\nB. No (f)\nAnswer:")


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_real_client_requests(scorer, name):
    request = REQUESTS[name]
    answers, usage = scorer.decide(request["state"], request["questions"])
    check_answers(request, answers)
    assert usage["input_tokens"] > 0 and usage["output_tokens"] == 0
    # each answer is what the full transformers model gives for that question's rendered prompt
    for key, q in request["questions"].items():
        ref, _ = reference_probs(scorer, request["state"], q)
        a = answers[key]
        got = [a["noul"]] if a["type"] == "noul" else list(a["probabilities"].values())
        assert got == pytest.approx(ref[:len(got)], abs=1e-4)


def test_real_client_requests_batched_equal_alone(scorer):
    reqs = [(r["state"], r["questions"]) for r in REQUESTS.values()]
    batched = scorer.decide_batch(reqs)
    for (state, questions), got in zip(reqs, batched):
        alone, _ = scorer.decide(state, questions)
        for key, a in alone.items():
            for field in ("probabilities", "noul"):
                if field in a:
                    assert got[key][field] == pytest.approx(a[field], abs=1e-4)
