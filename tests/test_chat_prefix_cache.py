"""Automatic prefix caching in the chat engine: the row pool alone, then the engine with the cache on and off."""
import random

import pytest
import torch

from core.chat import LLMEngine, SamplingParams
from core.chat.prefix_index import BLOCK, RowPool
from tests.test_chat_engine import collect


# ---- the pool, without a model

def test_match_exact_strict_prefix_partial_and_none():
    pool = RowPool(4)
    a = list(range(100, 150))
    pool.release(pool.allocate(), a)
    row = next(iter(pool.tokens))
    m = pool.match(a + [1, 2], limit=100)
    assert m.row == row and m.length == 50 and m.free
    assert pool.match(a[:20], limit=19).length == 19                 # capped: the last token is computed
    assert pool.match(a[:37] + [0, 0], limit=100).length == 37       # diverges mid-block
    assert pool.match([7, 8, 9], limit=100).length == 0
    assert pool.match(a[:3] + [0] * 40, limit=100).length == 3       # diverges inside the first block


def test_longest_match_wins_and_ties_go_to_a_free_row():
    pool = RowPool(3)
    base = list(range(40))
    held = pool.allocate()
    pool.hold(held, base + [1] * 10)
    free = pool.allocate()
    pool.release(free, base + [1] * 10)
    m = pool.match(base + [1] * 10 + [5], limit=100)
    assert (m.row, m.length, m.free) == (free, 50, True)
    pool.take(free)
    m = pool.match(base + [1] * 10 + [5], limit=100)
    assert (m.row, m.length, m.free) == (held, 50, False)            # a held row is a source to copy from


def test_eviction_is_least_recently_used_and_pinned_rows_stay():
    pool = RowPool(3)
    pool.pin(2, list(range(1000, 1020)))            # a pinned row is not in the pool's free rows
    rows = [pool.allocate() for _ in range(2)]
    assert set(rows) == {0, 1} and pool.n_free == 0
    pool.release(rows[1], [2] * 20)
    pool.release(rows[0], [1] * 20)                  # released last: the most recently used
    assert pool.allocate() == rows[1]                # the least recently used cached row goes first
    assert rows[1] not in pool.tokens and rows[0] in pool.tokens
    assert pool.match(list(range(1000, 1020)) + [5], limit=30).row == 2
    with pytest.raises(AssertionError):
        pool.take(2)
    assert pool.allocate() == rows[0] and pool.n_free == 0


def test_empty_rows_are_given_before_cached_ones():
    pool = RowPool(3)
    r = pool.allocate()
    pool.release(r, [3] * 40)
    assert pool.allocate() != r and pool.allocate() != r and pool.allocate() == r


def test_a_hash_collision_never_reuses_wrong_keys(monkeypatch):
    pool = RowPool(2)
    pool.release(pool.allocate(), [1] * BLOCK + [2] * BLOCK)
    monkeypatch.setattr(RowPool, "_chain", staticmethod(lambda tokens: [7] * (len(tokens) // BLOCK)))
    row = next(iter(pool.tokens))
    pool._blocks = {7: {row}}
    assert pool.match([9] * (2 * BLOCK) + [1], limit=100).length == 0


# ---- the engine with the cache on and off

def run(engine, requests):
    """requests: [(rid, prompt, params)] added together; -> {rid: {sample: tokens}}."""
    for rid, prompt, params in requests:
        engine.add_request(prompt, params, rid)
    return collect(engine)


def engines(model, tokenizer, **kw):
    return (LLMEngine(model, tokenizer, prefix_caching=True, **kw),
            LLMEngine(model, tokenizer, prefix_caching=False, **kw))


def conversation_turns(rng, turns, vocab=500):
    prompt = [rng.randrange(vocab) for _ in range(30)]
    for _ in range(turns):
        yield prompt
        prompt = prompt + [rng.randrange(vocab) for _ in range(rng.randint(5, 25))]


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 5)])
def test_a_conversation_continued_turn_by_turn(any_nanochat, tokenizer, temperature, seed):
    on, off = engines(any_nanochat, tokenizer, max_rows=4, initial_cache_len=32)
    rng = random.Random(0)
    history = [rng.randrange(500) for _ in range(30)]
    for turn in range(5):
        params = SamplingParams(max_tokens=12, temperature=temperature, seed=seed)
        a = run(on, [(f"t{turn}", history, params)])
        b = run(off, [(f"t{turn}", history, params)])
        assert a == b
        reply = a[f"t{turn}"][0]
        history = history + reply[:-1] + [rng.randrange(500) for _ in range(8)]   # the reply, then a new turn
    stats = on.stats()
    assert stats.prefix_hit_tokens > 0.5 * stats.prefix_query_tokens
    assert off.stats().prefix_hit_tokens == 0


def test_strict_prefix_equal_prompt_and_partial_match(any_nanochat, tokenizer):
    on, off = engines(any_nanochat, tokenizer, max_rows=3)
    rng = random.Random(1)
    base = [rng.randrange(500) for _ in range(70)]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    first = run(on, [("a", base, params)])
    assert first == run(off, [("a", base, params)])
    for rid, prompt in [("strict", base[:40]), ("equal", list(base)), ("partial", base[:53] + [1, 2, 3])]:
        assert run(on, [(rid, prompt, params)]) == run(off, [(rid, prompt, params)]), rid
    assert on.stats().prefix_hit_tokens >= 39 + 40 + 40    # "strict" took over the row "a" left, and so on


def test_many_requests_competing_for_few_rows(any_nanochat, tokenizer):
    on, off = engines(any_nanochat, tokenizer, max_rows=3, prefill_chunk=24)
    rng = random.Random(2)
    shared = [rng.randrange(500) for _ in range(40)]
    reqs = []
    for i in range(12):
        prompt = (shared if i % 2 else []) + [rng.randrange(500) for _ in range(rng.randint(3, 30))]
        reqs.append((f"r{i}", prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=i, n=1 + i % 3)))
    for wave in (reqs[:6], reqs[6:]):
        assert run(on, wave) == run(off, wave)
    assert on.stats().prefix_hit_tokens > 0


def test_n_samples_and_an_abort_while_a_row_is_shared(nanochat_model, tokenizer):
    on, off = engines(nanochat_model, tokenizer, max_rows=6)
    rng = random.Random(3)
    base = [rng.randrange(500) for _ in range(50)]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=9, n=3)
    assert run(on, [("n3", base, params)]) == run(off, [("n3", base, params)])
    # a long request holds its row; another copies its prompt's keys from it, and the first is aborted mid-way
    for engine in (on, off):
        engine.add_request(base + [1, 2], SamplingParams(max_tokens=40, temperature=0.0), "long")
        for _ in range(3):
            engine.step()
        engine.add_request(base + [1, 2, 3, 4], SamplingParams(max_tokens=10, temperature=0.0), "copy")
        engine.step()
        engine.abort("long")
    a, b = collect(on), collect(off)
    assert a["copy"] == b["copy"]
    assert run(on, [("again", base + [1, 2, 5], SamplingParams(max_tokens=6, temperature=0.0))]) == \
        run(off, [("again", base + [1, 2, 5], SamplingParams(max_tokens=6, temperature=0.0))])


def test_a_taken_over_rows_stale_tail_never_reaches_attention(nanochat_model, tokenizer):
    on = LLMEngine(nanochat_model, tokenizer, max_rows=1)
    rng = random.Random(4)
    base = [rng.randrange(500) for _ in range(60)]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    run(on, [("a", base, params)])
    row = next(iter(on.scheduler.pool.tokens))
    held = len(on.scheduler.pool.tokens[row])
    assert held == 60 + 8 - 1                          # prompt + generated, less the last (never fed)
    on.cache.k[:, row, :, 40:] = float("nan")          # poison everything past what the next prompt reuses
    on.cache.v[:, row, :, 40:] = float("nan")
    got = run(on, [("b", base[:40] + [9, 9], params)])
    assert on.stats().prefix_hit_tokens >= 40
    ref = LLMEngine(nanochat_model, tokenizer, max_rows=1, prefix_caching=False)
    assert got == run(ref, [("b", base[:40] + [9, 9], params)])


def test_few_shot_prefix_is_a_pinned_entry(any_nanochat, tokenizer):
    prefix = list(range(10, 40))
    on = LLMEngine(any_nanochat, tokenizer, max_rows=2, prefix_ids=prefix)
    bare = LLMEngine(any_nanochat, tokenizer, max_rows=2, prefix_caching=False)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    for i in range(4):                                  # more requests than rows: the pinned row is never evicted
        prompt = prefix + [100 + i, 7]
        assert run(on, [(f"p{i}", prompt, params)]) == run(bare, [(f"p{i}", prompt, params)])
    assert on.prefix_row in on.scheduler.pool.pinned and on.scheduler.pool.tokens[on.prefix_row] == prefix
    events = []
    on.add_request(prefix + [5, 5], params, "cached")
    while on.has_work():
        events += on.step()
    assert events[0].cached_tokens == len(prefix)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["nanochat", "modern"])
def test_cuda_prefix_cache_with_graphs_matches_off(tokenizer, arch):
    from tests.conftest import tiny_model

    model = tiny_model(arch, tokenizer).cuda()
    on = LLMEngine(model, tokenizer, max_rows=4, prefix_caching=True)
    off = LLMEngine(model, tokenizer, max_rows=4, prefix_caching=False, cuda_graphs=False)
    assert on.graphs is not None
    rng = random.Random(5)
    history = [rng.randrange(500) for _ in range(30)]
    for turn in range(4):
        params = SamplingParams(max_tokens=10, temperature=0.0)
        a, b = run(on, [(f"t{turn}", history, params)]), run(off, [(f"t{turn}", history, params)])
        assert a == b
        history = history + a[f"t{turn}"][0][:-1] + [rng.randrange(500) for _ in range(6)]
    assert torch.cuda.is_available()
