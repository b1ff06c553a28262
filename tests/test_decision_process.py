"""The decision scorer in its child process (core/decision/process.py) against the scorer in this process."""
import asyncio
import os
import signal
import time

import msgspec
import pytest

from core.decision import DecisionConfig, DecisionValidationError, StartLuxDecision, jevfmt as J
from core.decision.process import ProcessScorer, ScorerDied, ScorerStart, ThreadScorer
from tests.conftest import unreadable_records
from tests.decision_fixtures import build_checkpoint

REQUESTS = [
    ("the cat is red", {"c": {"question": "which color is the cat", "criteria": {"r": "red", "b": "blue"}},
                        "n": {"type": "noul", "question": "is there a cat"}}),
    ({"facts": ["dog blue"], "n": 2}, {"s": {"type": "score", "question": "how many",
                                              "criteria": {"a": "0", "b": "1", "c": "2"}}}),
    ("the cat is red", {"bad": {"type": "noul"}, "c": {"question": "which", "criteria": {"x": "1", "y": "2"}}}),
    ("the cat is red", {"c": {"question": "which color is the cat", "criteria": {"r": "red", "b": "blue"}}}),
]


def parsed(requests: list) -> list:
    """Wire-format (state, questions) pairs as the Ingress hands them on (the default template's parse)."""
    return [J.parse_request(state, questions) for state, questions in requests]


def builtins(results: list) -> list:
    """Scorer results as the wire shows them: (answers, usage) as JSON objects, refusals as they are."""
    return [r if isinstance(r, DecisionValidationError) else tuple(msgspec.to_builtins(r)) for r in results]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(str(tmp_path_factory.mktemp("decision-process")))


@pytest.fixture(scope="module")
def child(ckpt):
    scorer = ProcessScorer(ScorerStart(ckpt, DecisionConfig(max_batch_tokens=512), "cpu", 1))
    yield scorer
    scorer.shutdown()


def test_child_answers_as_the_scorer_here(ckpt, child):
    here = StartLuxDecision(ckpt, DecisionConfig(max_batch_tokens=512), device="cpu")
    expected = here.decide_batch(REQUESTS, with_usage=True, return_exceptions=True)
    got = builtins(asyncio.run(child.decide_batch(parsed(REQUESTS))))
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        if isinstance(e, DecisionValidationError):
            assert isinstance(g, DecisionValidationError) and g.errors == e.errors and str(g) == str(e)
            continue
        (answers, usage), (ref, ref_usage) = g, e
        assert usage == ref_usage and list(answers) == list(ref)
        for k in ref:
            for name, v in ref[k].items():
                assert answers[k][name] == (pytest.approx(v, abs=1e-5) if isinstance(v, (float, dict)) else v)
    # the repeated state was a prefix-cache hit there as here, and the parent sees the child's counters
    assert msgspec.to_builtins(child.prefix_stats()) == here.prefix_cache.stats()
    assert child.info.pid == child.pid != os.getpid() and child.info.max_batch_tokens == 512
    assert child.info.torch_threads == 1


def test_overlapping_calls_each_get_their_own_answers(child):
    async def both():
        return await asyncio.gather(child.decide_batch(parsed(REQUESTS[:2])), child.decide_batch(parsed(REQUESTS[3:])),
                                    child.decide_batch(parsed(REQUESTS[:1])))
    a, b, c = (builtins(x) for x in asyncio.run(both()))
    assert [list(x[0]) for x in a] == [["c", "n"], ["s"]] and list(b[0][0]) == ["c"]
    assert c[0][0]["c"]["choice"] == a[0][0]["c"]["choice"]
    assert c[0][0]["n"]["noul"] == pytest.approx(a[0][0]["n"]["noul"], abs=1e-5)


def test_thread_scorer_gives_the_same(ckpt, child):
    thread = ThreadScorer(ScorerStart(ckpt, DecisionConfig(max_batch_tokens=512), "cpu", None))
    got = builtins(asyncio.run(thread.decide_batch(parsed(REQUESTS[:2]))))
    ref = builtins(asyncio.run(child.decide_batch(parsed(REQUESTS[:2]))))
    assert [list(a) for a, _ in got] == [list(a) for a, _ in ref]
    assert [u["input_tokens"] for _, u in got] == [u["input_tokens"] for _, u in ref]     # (the child's cache is warm)
    assert thread.info.pid == os.getpid() and thread.alive()


def test_a_dead_child_fails_its_calls_and_reports_itself(ckpt):
    scorer = ProcessScorer(ScorerStart(ckpt, DecisionConfig(), "cpu", 1))
    try:
        assert scorer.alive()
        os.kill(scorer.pid, signal.SIGKILL)
        scorer.proc.wait(timeout=30)

        async def call():
            return await asyncio.wait_for(scorer.decide_batch(parsed(REQUESTS[:1])), 30)
        with pytest.raises(ScorerDied):
            asyncio.run(call())
        assert not scorer.alive()
    finally:
        scorer.shutdown()
    assert scorer.proc.poll() is not None


def test_a_child_that_cannot_load_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="failed to start"):
        ProcessScorer(ScorerStart(str(tmp_path / "missing"), DecisionConfig(), "cpu", 1))


def test_batch_merger_runs_what_came_meanwhile_as_one_call():
    from deployments.decision import BatchMerger

    calls = []

    async def run(items):
        calls.append(list(items))
        await asyncio.sleep(0.05)
        if "boom" in items:
            raise ValueError("boom")
        return [f"answer {x}" for x in items]

    async def scenario():
        merger = BatchMerger(run, max_size=4, depth=1)
        first = merger.submit(["a"])                      # starts at once, alone
        await asyncio.sleep(0)
        waiting = [merger.submit(["b", "c"]), merger.submit(["d"]), merger.submit(["e", "f"]), merger.submit(["g"])]
        gone = merger.submit(["x"])
        gone[0].cancel()                                   # its caller left before its turn: not run
        results = [await asyncio.gather(*fs) for fs in [first, *waiting]]
        failing = merger.submit(["boom"]) + merger.submit(["y"])
        outcome = await asyncio.gather(*failing, return_exceptions=True)
        later = await asyncio.gather(*merger.submit(["h"]))
        return results, outcome, later

    results, outcome, later = asyncio.run(scenario())
    # while "a" ran the rest queued: b c d together (e f would make 5 of 4), then e f g; x never ran
    assert calls[:3] == [["a"], ["b", "c", "d"], ["e", "f", "g"]]
    assert results == [["answer a"], ["answer b", "answer c"], ["answer d"], ["answer e", "answer f"], ["answer g"]]
    # submitted together while idle, boom and y run as one call; it raises, so both fail; the merger goes on
    assert calls[3:] == [["boom", "y"], ["h"]]
    assert all(isinstance(o, ValueError) for o in outcome) and later == ["answer h"]


def test_batch_merger_keeps_the_next_batch_waiting_at_the_scorer():
    """At depth 2 the scorer (here a stand-in that runs its calls one at a time, in the order sent, as the
    decision process does) is sent the next batch while it runs one, so it never waits for this loop between
    batches; never more than two calls are out, batches still merge what came meanwhile, and each request gets
    its own answer."""
    from deployments.decision import BatchMerger

    sent, ran, out, peak = [], [], [0], [0]

    async def scenario():
        device = asyncio.Lock()

        async def run(items):
            sent.append(list(items))
            out[0] += 1
            peak[0] = max(peak[0], out[0])
            async with device:
                ran.append(list(items))
                await asyncio.sleep(0.05)     # ten arrivals per call: a late loop still overlaps
            out[0] -= 1
            return [f"answer {x}" for x in items]

        merger = BatchMerger(run, max_size=4)
        futures = []
        for i in range(24):                         # a request every 5 ms
            futures += merger.submit([i])
            await asyncio.sleep(0.005)
        return await asyncio.gather(*futures)

    answers = asyncio.run(scenario())
    assert answers == [f"answer {i}" for i in range(24)]
    assert ran == sent and [x for b in ran for x in b] == list(range(24))     # in order, each once
    assert max(len(b) for b in ran) > 1                                       # merged what came meanwhile
    assert len(ran) < 24
    assert peak[0] == 2               # a batch was sent while another ran, and never more than two were out


def test_memory_return_gives_freed_heap_pages_back():
    """What the decision child relies on: after many small blocks are freed between blocks still held, glibc
    keeps the pages; MemoryReturn's trim hands them back (and not more often than its interval)."""
    import ctypes

    from core.decision.memory import MemoryReturn, resident_kb

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 * 1024) for _ in range(4000)]      # 250 MB below the mmap threshold: on the heap
    for b in blocks:
        ctypes.memset(b, 1, 64 * 1024)
    memory = MemoryReturn(interval_s=3600)
    held = memory.heap()
    for b in blocks[:-1]:                                       # the last one pins the heap's top
        libc.free(b)
    freed = memory.heap()                                       # glibc's account sees the blocks go to its free lists
    for taken, given in ((held["in_use"], freed["in_use"]), (freed["free"], held["free"])):
        assert 3999 * 64 * 1024 <= taken - given < 3999 * 64 * 1024 + 2 ** 20, (held, freed)
    memory.last -= 3600
    before = resident_kb()
    assert memory.maybe() and not memory.maybe()                # once, then not until the interval has passed
    after = resident_kb()
    report = memory.report()                                    # the heap as the trim left it, in MB
    assert report["returns"] == 1 and abs(report["in_use"] - freed["in_use"] / 2 ** 20) < 1, (report, freed)
    libc.free(blocks[-1])
    assert before - after > 200 * 1024, (before, after)


def test_the_child_returns_memory_between_batches(ckpt):
    # an interval that has always passed by the next batch: a return after every batch
    scorer = ProcessScorer(ScorerStart(ckpt, DecisionConfig(max_batch_tokens=512), "cpu", 1, return_memory_s=1e-9))
    try:
        for _ in range(3):        # each Done counts the returns before it: the one after the 2nd shows in the 3rd
            asyncio.run(scorer.decide_batch(parsed(REQUESTS[:1])))
            # the child returns memory only when no batch waits (`conn.poll()` after it sent Done): a next batch sent
            # at once races that check on a busy host, so the test leaves the child idle between batches
            time.sleep(0.5)
        assert scorer.memory["returns"] == 2
        assert scorer.memory["in_use"] > 1 and scorer.memory["free"] >= 0   # the child's heap after its trim, MB
    finally:
        scorer.shutdown()


def test_an_unreadable_record_fails_the_call_instead_of_hanging(ckpt, monkeypatch):
    """A record the parent cannot read (a child started from other code than the parent's) ends the reader:
    the waiting call fails with ScorerDied, the scorer reports itself dead, and nothing hangs."""
    from core.decision import protocol

    scorer = ProcessScorer(ScorerStart(ckpt, DecisionConfig(max_batch_tokens=512), "cpu", 1))
    try:
        unreadable_records(monkeypatch, protocol, "Done")
        with pytest.raises(ScorerDied):
            asyncio.run(asyncio.wait_for(scorer.decide_batch(parsed(REQUESTS[:1])), 120))
        assert not scorer.alive()
    finally:
        monkeypatch.undo()
        scorer.shutdown()


# ---- the synthetic scorer (decision_scorer: synthetic)

BAD = [("s", {}), ("s", {"a": {"type": "score", "criteria": ["one"]}, "b": {"type": "guess"}}),
       ("s", {"a": {"criteria": {}}, "ok": {"type": "noul"}, "c": {"type": "noul", "criteria": {"maybe": "x"}}}),
       ("s", {"a": {"instructions": "x", "question": "y", "criteria": {"p": "q"}}}), (float("nan"), {"a": {"type": "noul"}}),
       ("s", {"a": "not an object"})]


def test_the_synthetic_scorer_answers_and_refuses_as_the_scorer_does(ckpt, monkeypatch):
    """Same refusals (every bad key, the same words) and answers of the same shapes as the real scorer's, on the
    client-shaped requests; a state sent again counts as cached; a batch sleeps its configured time."""
    from core.decision import synthetic
    from tests.systemone_requests import REQUESTS, check_answers

    slept = []
    monkeypatch.setattr(synthetic.time, "sleep", slept.append)
    real = StartLuxDecision(ckpt, DecisionConfig(max_batch_tokens=512), device="cpu")
    fake = synthetic.SyntheticScorer(ckpt, DecisionConfig(backend="synthetic", synthetic_question_s=0.5,
                                                          synthetic_batch_s=0.25))
    pairs = [(r["state"], r["questions"]) for r in REQUESTS.values()]
    got = fake.decide_batch(pairs + BAD, with_usage=True, return_exceptions=True)
    want = real.decide_batch(pairs + BAD, with_usage=True, return_exceptions=True)
    assert slept == [0.25 + 0.5 * sum(len(q) for _, q in pairs)]
    for request, (answers, usage), (real_answers, real_usage) in zip(REQUESTS.values(), got, want):
        check_answers(request, answers)
        assert {k: sorted(a) for k, a in answers.items()} == {k: sorted(a) for k, a in real_answers.items()}
        assert usage["input_tokens"] > 0 and set(usage) == set(real_usage)
    for g, w in zip(got[len(pairs):], want[len(pairs):]):
        assert isinstance(g, DecisionValidationError) and g.errors == w.errors
    again = fake.decide_batch([pairs[0]], with_usage=True)[0][1]
    assert again["input_tokens_details"]["cached_tokens"] > 0 == got[0][1]["input_tokens_details"]["cached_tokens"]


def test_settings_select_the_synthetic_scorer_and_its_process_runs_without_torch(ckpt):
    from deployments.settings import AppArgs

    d = AppArgs.model_validate({"decision_scorer": "synthetic", "decision_synthetic_question_s": 0}).decision
    assert d.scorer.backend == "synthetic" and d.scorer.synthetic_question_s == 0
    assert AppArgs.model_validate({}).decision.scorer.backend == "model" and d.name == "startlux-decision"
    with pytest.raises(ValueError, match="synthetic"):
        AppArgs.model_validate({"decision_scorer": "fast"})
    scorer = ProcessScorer(ScorerStart(ckpt, d.scorer, "cpu", 1))
    try:
        assert scorer.info.device == "synthetic"
        with open(f"/proc/{scorer.info.pid}/maps") as f:
            assert "libtorch" not in f.read()
        (answers, usage), refused = builtins(asyncio.run(scorer.decide_batch(parsed([("s", {"a": {"type": "noul"}}),
                                                                                      BAD[1]]))))
        assert answers == {"a": {"type": "noul", "noul": 0.5}} and set(refused.errors) == {"a", "b"}
    finally:
        scorer.shutdown()
