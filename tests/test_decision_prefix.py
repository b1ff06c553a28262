"""The decision scorer's shared state: prefix passes, the prefix cache and pass planning, against full prompts."""
import itertools
import random

import pytest
import torch

from core.decision import StartLuxDecision
from core.decision.passes import HELD_PER_COMPUTED, PassCost, plan
from core.decision.prefix_cache import PrefixCache
from tests.decision_fixtures import build_checkpoint
from tests.systemone_requests import REQUESTS

WORDS = "the cat dog red blue green apple pear plum city river one two three".split()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(str(tmp_path_factory.mktemp("decision_prefix")), seed=3)


@pytest.fixture(scope="module")
def full(ckpt):
    """The reference: every prompt run whole (the seed's way), same rendering."""
    return StartLuxDecision(ckpt, device="cpu", share_prefix=False)


@pytest.fixture
def shared(ckpt):
    """A fresh scorer per test, so the prefix cache starts empty."""
    return StartLuxDecision(ckpt, device="cpu", max_batch_tokens=4096)


def text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def questions(rng, n, long_tail_every=0):
    qs = {}
    for i in range(n):
        kind = ("choice", "noul", "score")[i % 3]
        instructions = text(rng, 40 if long_tail_every and i % long_tail_every == 0 else 4)
        if kind == "choice":
            qs[f"q{i}"] = {"instructions": instructions, "criteria": {f"o{j}": text(rng, 2) for j in range(2 + i % 4)}}
        elif kind == "noul":
            qs[f"q{i}"] = {"type": "noul", "instructions": instructions}
        else:
            qs[f"q{i}"] = {"type": "score", "instructions": instructions, "criteria": [text(rng, 1) for _ in range(4)]}
    return qs


def assert_same(a: dict, b: dict, tol=1e-4):
    assert list(a) == list(b)
    for k in a:
        for field in ("probabilities", "noul", "score", "confidence"):
            if field in a[k]:
                assert a[k][field] == pytest.approx(b[k][field], abs=tol), (k, field)
        if "choice" in a[k]:
            pa = a[k]["probabilities"]
            assert max(pa.values()) - pa[b[k]["choice"]] < tol


def test_one_and_eight_questions_match_full_prompts(shared, full):
    rng = random.Random(0)
    state = text(rng, 300)
    for n in (1, 8):
        qs = questions(rng, n)
        got, usage = shared.decide(state, qs)
        ref, ref_usage = full.decide(state, qs)
        assert_same(got, ref)
        assert usage["input_tokens"] == ref_usage["input_tokens"]


def test_tails_of_very_different_lengths(shared, full):
    rng = random.Random(1)
    qs = questions(rng, 7, long_tail_every=3)
    lengths = {len(p.tail) for p in shared.prepare(shared.parse("s", qs)).prompts}
    assert max(lengths) > 3 * min(lengths)
    state = text(rng, 120)
    assert_same(shared.decide(state, qs)[0], full.decide(state, qs)[0])


def test_tournament_over_60_options_matches(shared, full):
    rng = random.Random(2)
    criteria = {f"k{i}": text(rng, 2) for i in range(60)}
    qs = {"w": {"instructions": "which one", "criteria": criteria}, "n": {"type": "noul", "instructions": "is it"}}
    state = text(rng, 200)
    got, usage = shared.decide(state, qs)
    ref, ref_usage = full.decide(state, qs)
    assert_same(got, ref)
    assert usage["input_tokens"] == ref_usage["input_tokens"]


def test_cut_state_is_cut_once_and_matches(ckpt):
    rng = random.Random(3)
    shared = StartLuxDecision(ckpt, device="cpu", max_length=160)
    full = StartLuxDecision(ckpt, device="cpu", max_length=160, share_prefix=False)
    state = text(rng, 400) + " FINAL"
    qs = questions(rng, 5, long_tail_every=2)
    prep = shared.prepare(shared.parse(state, qs))
    assert len({tuple(p.prefix) for p in prep.prompts}) == 1           # one cut for every question
    assert max(len(p.ids) for p in prep.prompts) == 160
    assert shared.tok.decode(prep.prefix).rstrip().endswith("FINAL")
    got, usage = shared.decide(state, qs)
    assert_same(got, full.decide(state, qs)[0])
    assert usage["input_tokens"] == sum(len(p.ids) for p in prep.prompts)


def test_batch_of_states_of_different_lengths(shared, full):
    rng = random.Random(4)
    reqs = [(text(rng, n), questions(rng, k)) for n, k in ((10, 2), (400, 3), (0, 2), (150, 1), (400, 4))]
    reqs.append((reqs[1][0], questions(rng, 2)))          # a second request about the same state
    reqs += [(r["state"], r["questions"]) for r in REQUESTS.values()]
    batched = shared.decide_batch(reqs, with_usage=True)
    for (state, qs), (answers, usage) in zip(reqs, batched):
        ref, ref_usage = full.decide(state, qs)
        assert_same(answers, ref)
        assert usage["input_tokens"] == ref_usage["input_tokens"]
    # the repeated state was computed once: its second request reports it as cached
    state_tokens = len(shared.prepare(shared.parse(reqs[1][0], reqs[1][1])).prefix)
    assert batched[1][1]["input_tokens_details"]["cached_tokens"] == 0
    assert batched[5][1]["input_tokens_details"]["cached_tokens"] == 2 * state_tokens


def test_prefix_cache_hit_and_miss(shared, full):
    rng = random.Random(5)
    state, qs = text(rng, 250), questions(rng, 4)
    first, u1 = shared.decide(state, qs)
    stats = shared.prefix_cache.stats()
    assert u1["input_tokens_details"]["cached_tokens"] == 0 and stats["hit_tokens"] == 0
    again, u2 = shared.decide(state, questions(rng, 3))           # other questions about the same state: a hit
    prefix = len(shared.prepare(shared.parse(state, qs)).prefix)
    assert u2["input_tokens_details"]["cached_tokens"] == 3 * prefix
    assert shared.prefix_cache.stats()["hit_tokens"] == prefix
    calls = []
    original = shared._prefix_state
    shared._prefix_state = lambda ids: calls.append(len(ids)) or original(ids)
    hit, _ = shared.decide(state, qs)
    assert not calls, "a cached prefix is not computed again"
    assert_same(hit, first, tol=1e-5)
    assert_same(hit, full.decide(state, qs)[0])


def test_prefix_cache_stays_within_its_bound_and_evicts_lru(ckpt, full):
    rng = random.Random(6)
    probe = StartLuxDecision(ckpt, device="cpu")
    probe.decide(text(rng, 200), questions(rng, 1))
    one = probe.prefix_cache.bytes                      # the size of one ~200-token prefix state
    s = StartLuxDecision(ckpt, device="cpu", prefix_cache_mb=3.5 * one / 2 ** 20)
    states = [text(rng, 200) for _ in range(8)]
    qs = questions(rng, 2)
    for st in states:
        s.decide(st, qs)
        assert s.prefix_cache.bytes <= s.prefix_cache.capacity_bytes
    held = [st for st in states if s.prepare(s.parse(st, qs)).prefix in s.prefix_cache]
    assert held == states[-len(held):] and 1 <= len(held) <= 3      # the most recent, in order
    s.decide(states[-len(held)], qs)                    # touch the oldest held one: it becomes the newest
    s.decide(text(rng, 200), qs)                        # a new state evicts the least recently used
    assert s.prepare(s.parse(states[-len(held)], qs)).prefix in s.prefix_cache
    evicted = states[0]
    assert s.prepare(s.parse(evicted, qs)).prefix not in s.prefix_cache
    got, usage = s.decide(evicted, qs)                  # recomputed after eviction, and right
    assert usage["input_tokens_details"]["cached_tokens"] == 0
    assert_same(got, full.decide(evicted, qs)[0])


def test_prefix_cache_unit():
    from core.decision.prefix_cache import PrefixState

    def state(n):
        return PrefixState(n, ["full_attention"], [(torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2))])

    c = PrefixCache(capacity_bytes=state(10).nbytes * 2)
    c.put([1], state(10))
    c.put([2], state(10))
    assert c.get([1]) is not None                       # 1 is now the most recent
    c.put([3], state(10))
    assert [2] not in c and [1] in c and [3] in c and c.bytes == 2 * state(10).nbytes
    c.put([4], state(30))                               # larger than the whole cache: not kept
    assert [4] not in c and len(c) == 2
    assert c.stats()["query_tokens"] == 1 and c.stats()["hit_tokens"] == 1


def fits(n, L, T, max_tokens):
    return n == 1 or (n * T <= max_tokens and n * (L + T) <= HELD_PER_COMPUTED * max_tokens)


def brute_force(rows, max_tokens, cost):
    """Every partition of the length-sorted rows into consecutive passes."""
    order = sorted(range(len(rows)), key=lambda i: (-rows[i][0], -rows[i][1]))
    best = None
    for cuts in itertools.product([0, 1], repeat=len(order) - 1):
        groups, cur = [], [order[0]]
        for c, i in zip(cuts, order[1:]):
            if c:
                groups.append(cur)
                cur = []
            cur.append(i)
        groups.append(cur)
        total = 0.0
        for g in groups:
            L, T = max(rows[i][0] for i in g), max(rows[i][1] for i in g)
            if not fits(len(g), L, T, max_tokens):
                break
            total += cost.of_pass(len(g), L, T)
        else:
            best = total if best is None else min(best, total)
    return best


def test_plan_is_optimal_bounded_and_never_worse_than_one_pass_each():
    rng = random.Random(7)
    for device in ("cpu", "cuda"):
        cost = PassCost(token_flops=1e6, key_flops=4e3, overhead_tokens=64 if device == "cpu" else 2048)
        for _ in range(30):
            rows = [(rng.choice([0, 50, 300, 1000]), rng.randint(5, 80)) for _ in range(rng.randint(1, 9))]
            passes = plan(rows, 256, cost)
            assert sorted(i for p in passes for i in p) == list(range(len(rows)))
            total = 0.0
            for p in passes:
                L, T = max(rows[i][0] for i in p), max(rows[i][1] for i in p)
                assert fits(len(p), L, T, 256)
                total += cost.of_pass(len(p), L, T)
            assert total == pytest.approx(brute_force(rows, 256, cost))
            assert total <= sum(cost.of_pass(1, L, T) for L, T in rows) + 1e-6


@pytest.mark.gpu
def test_cuda_shared_prefix_matches_full_prompts(ckpt):
    """On CUDA (fp32, the kernels transformers picks there), the shared-prefix passes answer as full prompts do."""
    import os

    from core.decision.kernels import linear_attention_kernels

    if os.environ.get("STARTLUX_ALLOW_SLOW") != "1" and any(
            v == "torch" for v in linear_attention_kernels(__import__("transformers").Qwen3_5ForCausalLM).values()):
        pytest.skip("fast kernels not installed")
    shared = StartLuxDecision(ckpt, device="cuda", dtype=torch.float32, graphs=False)
    full = StartLuxDecision(ckpt, device="cuda", dtype=torch.float32, graphs=False, share_prefix=False)
    rng = random.Random(8)
    reqs = [(text(rng, n), questions(rng, k)) for n, k in ((300, 8), (40, 2), (0, 3), (300, 1))]
    for (state, qs), (answers, _) in zip(reqs, shared.decide_batch(reqs, with_usage=True)):
        assert_same(answers, full.decide(state, qs)[0], tol=2e-3)


def test_tail_buckets_are_closed_downwards_and_pick_the_smallest():
    from core.decision.graphs import pick_tail, tail_shapes

    shapes = tail_shapes()
    assert len(shapes) == len(set(shapes))
    for r, p, t in shapes:
        assert r * t <= 8192 and r * (p + t) <= 65536
    assert pick_tail(3, 300, 40, shapes) == (4, 512, 64)
    assert pick_tail(1, 0, 1, shapes) == (1, 256, 32)
    assert pick_tail(64, 256, 100, shapes) == (64, 256, 128)
    assert pick_tail(64, 2000, 32, shapes) is None               # 64 rows hold at most 1,024 positions each
    assert pick_tail(65, 10, 10, shapes) is None and pick_tail(1, 5000, 10, shapes) is None
    # largest first by activations, so the shared pool is sized by the first graph recorded
    assert shapes[0][0] * shapes[0][2] == max(r * t for r, _, t in shapes)


def test_static_tail_pass_matches_the_eager_pass(ckpt, full):
    """The tail graphs' formulation (static buffers per bucket, keys left-padded to the bucket and masked, dummy
    rows, buffers shared between buckets), run eagerly on the CPU, answers as the eager tail pass and as full
    prompts; only the capture itself needs a GPU (test_cuda_tail_graphs_match_eager)."""
    rng = random.Random(9)
    reqs = [(text(rng, n), questions(rng, k, long_tail_every=2)) for n, k in
            ((10, 2), (200, 3), (0, 2), (90, 1), (200, 4), (35, 5))]
    eager = StartLuxDecision(ckpt, device="cpu", max_batch_tokens=4096)
    static = StartLuxDecision(ckpt, device="cpu", max_batch_tokens=4096)
    shapes = [(r, p, t) for r in (1, 2, 4, 8, 16) for p in (64, 128, 256) for t in (32, 64, 128)]
    static.tail_graphs = static.new_tail_graphs(shapes, capture=False)
    used = []
    pick = static.tail_graphs.shape_for
    static.tail_graphs.shape_for = lambda states, tails: used.append(pick(states, tails)) or used[-1]
    for _ in range(2):                                  # the second time from the prefix cache
        got = static.decide_batch(reqs, with_usage=True)
        ref = eager.decide_batch(reqs, with_usage=True)
        for (answers, usage), (ref_answers, ref_usage), (state, qs) in zip(got, ref, reqs):
            assert_same(answers, ref_answers, tol=1e-5)
            assert_same(answers, full.decide(state, qs)[0])
            assert usage == ref_usage
    assert any(u is not None for u in used)             # the buckets took the passes
    # one request alone: its questions in one bucket; and a pass no bucket holds runs eagerly
    state, qs = text(rng, 300), questions(rng, 3)
    assert_same(static.decide(state, qs)[0], full.decide(state, qs)[0])
    assert used[-1] is None
    # the buckets' state buffers are views of one buffer per layer and tensor
    layers = [b.layers[0][0] for b in static.tail_graphs.buffers.values()]
    assert len({t.untyped_storage().data_ptr() for t in layers}) == 1


@pytest.mark.gpu
def test_cuda_tail_graphs_match_eager(ckpt):
    """On CUDA, a batch's state-once passes replay recorded tail graphs and answer as the eager passes do, within
    the readout tolerance, from fresh and from cached prefix states."""
    import os

    from core.decision.kernels import linear_attention_kernels

    if os.environ.get("STARTLUX_ALLOW_SLOW") != "1" and any(
            v == "torch" for v in linear_attention_kernels(__import__("transformers").Qwen3_5ForCausalLM).values()):
        pytest.skip("fast kernels not installed")
    graphed = StartLuxDecision(ckpt, device="cuda", dtype=torch.float32)
    eager = StartLuxDecision(ckpt, device="cuda", dtype=torch.float32, graphs=False)
    assert graphed.tail_graphs is not None and graphed.tail_graphs.graphs
    replays = []
    replay = graphed.tail_graphs.replay
    graphed.tail_graphs.replay = lambda *a: replays.append(a[0]) or replay(*a)
    rng = random.Random(10)
    reqs = [(text(rng, n), questions(rng, k, long_tail_every=2)) for n, k in
            ((300, 8), (40, 2), (0, 3), (300, 1), (900, 4), (120, 6))]
    for _ in range(2):
        for (answers, _), (ref, _) in zip(graphed.decide_batch(reqs, with_usage=True),
                                          eager.decide_batch(reqs, with_usage=True)):
            assert_same(answers, ref, tol=2e-3)
    assert replays
