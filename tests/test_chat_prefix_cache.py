"""Automatic prefix caching in the chat engine: the block pool alone, then the engine with the cache on and off."""
import random

import pytest
import torch

from core.chat import LLMEngine, SamplingParams
from core.chat.kv_cache import KVCache, LayerGroups
from core.chat.protocol import EngineError
from core.chat.block_pool import SCRATCH, BlockPool, chain
from tests.test_chat_engine import collect


# ---- the block pool, without a model

def held(pool, tokens, group=0):
    """A sequence of `tokens` in fresh blocks, its full blocks registered; -> its table."""
    blocks = pool.allocate(pool.blocks_for(len(tokens)))
    digests = chain(tokens, pool.block_size, [])
    pool.commit(group, blocks, digests, 0, len(digests))
    return blocks


def lookup(pool, tokens, limit=10**6, group=0):
    """The cached blocks that hold the longest prefix of `tokens` (at most `limit` tokens), in whole blocks."""
    out = []
    for d in chain(tokens[:limit], pool.block_size, []):
        b = pool.cached(group, d)
        if b is None:
            break
        out.append(b)
    return out


def test_a_prefix_is_found_in_whole_blocks_and_shared_by_reference():
    pool = BlockPool(16, 4)
    a = list(range(100, 118))                         # 4 full blocks and 2 tokens
    table = held(pool, a)
    assert len(table) == 5 and SCRATCH not in table
    assert lookup(pool, a + [1, 2]) == table[:4]
    assert lookup(pool, a[:9], 8) == table[:2]        # capped: whole blocks within the limit
    assert lookup(pool, a[:6] + [0] * 10) == table[:1]   # diverges in the second block
    assert lookup(pool, [7] + a[1:]) == []             # a key names its tokens from position 0
    assert lookup(pool, a, group=1) == []              # and its layer group
    hit = lookup(pool, a, 17)
    pool.take(hit)
    assert all(pool.ref[b] == 2 for b in hit) and pool.ref[table[4]] == 1
    pool.release(table)
    assert all(pool.ref[b] == 1 for b in hit) and pool.cached_blocks == 0
    pool.release(hit)
    assert pool.cached_blocks == 4 and pool.in_use == 0


def test_fresh_blocks_first_then_uncached_then_least_recently_released():
    pool = BlockPool(9, 4)                             # 8 usable
    old = held(pool, list(range(8)))                  # 2 cached blocks
    new = held(pool, list(range(50, 58)))
    scratch = pool.allocate(2)                         # 2 blocks caching nothing
    assert pool.available == 2
    pool.release(old)
    pool.release(scratch)
    pool.release(new)                                  # released last: the most recently used
    got = pool.allocate(2)
    assert set(got) == set(range(7, 9))                # never used before any queued block
    assert set(pool.allocate(2)) == set(scratch)       # then the blocks that cache nothing
    assert lookup(pool, list(range(8))) == old
    took = pool.allocate(1)                            # then the least recently released: old's tail first
    assert took == [old[1]] and lookup(pool, list(range(8))) == old[:1]
    assert lookup(pool, list(range(50, 58))) == new and pool.evictions == 1


def test_a_blocks_key_depends_on_tokens_alone():
    """A block stays findable after the block before it was reused (what a sliding window needs): its key is
    the digest of every token up to its end, not the identity of the blocks before it."""
    pool = BlockPool(4, 4)
    a = held(pool, [1, 1, 1, 1, 2, 2, 2, 2])
    pool.release(a)
    pool.take(a[1:])                                   # keep the second block, let the first go
    pool.allocate(1)                                   # the last fresh block
    assert pool.allocate(1) == a[:1]                   # the first block is reused: its key is gone
    digests = chain([1, 1, 1, 1, 2, 2, 2, 2], 4, [])
    assert pool.cached(0, digests[0]) is None and pool.cached(0, digests[1]) == a[1]
    assert chain([1, 1, 1, 1, 3, 3, 3, 3], 4, [])[1] != digests[1]


def test_a_block_with_the_content_of_a_cached_one_stays_private():
    pool = BlockPool(8, 4)
    a = held(pool, [5] * 8)
    b = pool.allocate(2)
    pool.commit(0, b, chain([5] * 8, 4, []), 0, 2)     # the same keys as a's: b's stay unregistered
    pool.release(b)
    assert pool.cached_blocks == 0 and lookup(pool, [5] * 9) == a


def test_allocation_takes_nothing_when_too_few_are_left():
    pool = BlockPool(4, 4)
    assert pool.allocate(4) is None and pool.available == 3
    assert pool.allocate(3) is not None and pool.allocate(1) is None


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
    on, off = engines(any_nanochat, tokenizer, max_rows=4, block_size=8)
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
    assert on.stats().prefix_hit_tokens >= 32 + 64 + 48    # whole blocks of 16: "strict" finds 2 of "a"'s, ...


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


def test_a_hit_shares_the_blocks_and_reads_nothing_past_them(nanochat_model, tokenizer):
    """The second prompt's table starts with the first's cached blocks (the same ids: nothing copied); poisoning
    every other block the first used changes nothing the second computes."""
    on = LLMEngine(nanochat_model, tokenizer, max_rows=1, block_size=8)
    rng = random.Random(4)
    base = [rng.randrange(500) for _ in range(60)]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    tables = {}
    spy = on.scheduler.prefilled

    def remember(req):
        tables[req.id] = list(req.samples[0].tables[0])
        return spy(req)

    on.scheduler.prefilled = remember
    run(on, [("a", base, params)])
    shared = tables["a"][:5]                                  # 40 tokens: 5 blocks of 8
    rest = [b for b in tables["a"] if b not in shared]
    on.cache.k[:, rest] = float("nan")                        # poison what the next prompt must not read
    on.cache.v[:, rest] = float("nan")
    got = run(on, [("b", base[:40] + [9, 9], params)])
    assert tables["b"][:5] == shared and not set(tables["b"][5:]) & set(shared)
    assert on.stats().prefix_hit_tokens == 40
    ref = LLMEngine(nanochat_model, tokenizer, max_rows=1, prefix_caching=False)
    assert got == run(ref, [("b", base[:40] + [9, 9], params)])


def test_n_samples_share_their_prompts_blocks(nanochat_model, tokenizer):
    """n=3 of a 21-token prompt in blocks of 8: the samples list the same two full blocks and each its own copy of
    the third, partly filled one; while they run those two blocks have three holders."""
    engine = LLMEngine(nanochat_model, tokenizer, max_rows=3, block_size=8)
    engine.add_request(list(range(40, 61)), SamplingParams(max_tokens=5, temperature=1.0, seed=1, n=3), "n")
    engine.step()
    engine.step()
    samples = engine.scheduler.running[0].samples
    firsts = {tuple(s.tables[0][:2]) for s in samples}
    thirds = {s.tables[0][2] for s in samples}
    assert len(firsts) == 1 and len(thirds) == 3
    assert all(engine.scheduler.pool.ref[b] == 3 for b in samples[0].tables[0][:2])


@pytest.mark.parametrize("arch", ["nanochat", "modern", "gpt2"])
def test_memory_per_stored_token_is_the_floor(arch, tokenizer):
    """The pool's bytes over the positions its blocks hold, every layer group together: 2 x layers x kv_heads x
    head_dim x bytes; the pool takes all of kv_cache_memory but less than a block."""
    from tests.conftest import tiny_model

    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model(arch, tokenizer).to(dtype)
        engine = LLMEngine(model, tokenizer, max_rows=2, kv_cache_memory=1 << 20)
        c, cache = model.config, engine.cache
        floor = 2 * c.n_layer * c.n_kv_head * c.head_dim * dtype.itemsize
        per_block = KVCache.block_bytes(c, cache.block_size, dtype)
        assert per_block * len(cache.groups) == floor * cache.block_size
        assert cache.nbytes() == per_block * cache.n_blocks
        assert (1 << 20) - per_block < cache.nbytes() <= 1 << 20


def template_conversations(n, rng, vocab=500):
    """n conversations whose prompts begin as the chat template makes them all begin (<|bos|>, the template's
    tokens, one system prompt: 24 tokens in common), each with its own first user message."""
    start = [rng.randrange(vocab) for _ in range(24)]
    return [start + [rng.randrange(vocab) for _ in range(rng.randint(20, 40))] for _ in range(n)]


@pytest.mark.parametrize("block_size", [8, 16])
def test_interleaved_conversations_keep_their_history_cached(nanochat_model, tokenizer, block_size):
    """Twelve conversations with a common start, turn 1 of each, then turn 2 of each, then turn 3, on an engine of
    4 rows: every later turn finds its whole history cached (its last prompt and the reply, in whole blocks) and
    generates what the engine without a cache generates. One row per conversation would have kept none."""
    rng = random.Random(11)
    histories = template_conversations(12, rng)
    on, off = engines(nanochat_model, tokenizer, max_rows=4, block_size=block_size)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    for turn in range(3):
        for c, history in enumerate(histories):
            rid = f"c{c}t{turn}"
            events = []
            on.add_request(history, params, rid)
            while on.has_work():
                events += on.step()
            got = [ev.token for ev in events if ev.token is not None]
            assert {rid: {0: got}} == run(off, [(rid, history, params)])
            if turn:
                seen = prior[c]
                assert events[0].cached_tokens >= (seen // block_size) * block_size, (rid, events[0].cached_tokens)
            histories[c] = history + got[:-1] + [rng.randrange(500) for _ in range(8)]
        prior = [len(h) - 8 for h in histories]


def ample_and_tight(model, tokenizer, extra: int, **kw):
    """An engine with memory to spare and one whose KV cache has blocks of 8 for one sequence of the whole
    context in every layer group (the least it may have) and `extra` more."""
    per = KVCache.block_bytes(model.config, 8, torch.float32)
    groups = len(LayerGroups.of(model.config.layer_windows))
    blocks = 1 + groups * -(-model.config.sequence_len // 8) + extra
    return (LLMEngine(model, tokenizer, block_size=8, **kw),
            LLMEngine(model, tokenizer, block_size=8, kv_cache_memory=per * blocks, **kw))


@pytest.mark.parametrize("arch", ["nanochat", "modern"])
def test_preemption_and_eviction_change_no_token(arch, tokenizer):
    """Eight requests (greedy, seeded, n=2, penalties, a stop) that need more blocks than the cache has: running
    requests are preempted and computed again, cached blocks evicted, and every token equals the run with memory
    to spare; afterwards every block is back."""
    from tests.conftest import tiny_model

    model = tiny_model(arch, tokenizer, seed=5, std=0.3)
    ample, tight = ample_and_tight(model, tokenizer, 3, max_rows=8, prefill_chunk=48)
    rng = random.Random(6)
    common = [rng.randrange(500) for _ in range(20)]
    reqs = []
    for i in range(8):
        prompt = common + [rng.randrange(500) for _ in range(rng.randint(4, 30))]
        params = SamplingParams(max_tokens=60, temperature=0.0 if i % 2 else 1.0, seed=i, n=1 + (i == 3),
                                frequency_penalty=0.5 if i == 5 else 0.0, ignore_eos=True)
        reqs.append((f"r{i}", prompt, params))
    a, b = run(ample, reqs), run(tight, reqs)
    assert a == b
    stats = tight.stats()
    assert stats.preemptions > 0 and ample.stats().preemptions == 0
    assert stats.blocks_used == 0 and stats.running == 0 and stats.rows_used == 0
    second = run(tight, reqs[:3])                       # what stayed cached is still right
    assert second == {rid: a[rid] for rid, _, _ in reqs[:3]}
    assert tight.stats().evictions > 0


def test_an_abort_while_preempted_gives_everything_back(nanochat_model, tokenizer):
    _, tight = ample_and_tight(nanochat_model, tokenizer, 1, max_rows=6)
    for i in range(6):
        tight.add_request(list(range(10 + i, 40 + i)), SamplingParams(max_tokens=80, ignore_eos=True), f"r{i}")
    while not tight.stats().preemptions:
        tight.step()
    victim = next(r for r in tight.scheduler.waiting if r.preempted)
    tight.abort(victim.id)
    events = []
    while tight.has_work():
        events += tight.step()
    ends = {ev.request_id: ev.finish_reason for ev in events if ev.finish_reason}
    assert ends[victim.id] == "abort" and set(ends.values()) == {"abort", "length"}
    stats = tight.stats()
    assert stats.rows_used == 0 and stats.blocks_used == 0


def test_a_request_that_can_never_fit_is_refused_naming_the_limit(nanochat_model, tokenizer):
    """A request whose samples could not reach their end in the whole cache at once is refused when it is added
    (preemption could never finish it); the engine goes on serving the others."""
    _, tight = ample_and_tight(nanochat_model, tokenizer, 1, max_rows=4)
    with pytest.raises(EngineError, match="chat_kv_cache_memory"):
        tight.add_request(list(range(50)), SamplingParams(max_tokens=200, n=4), "big")
    assert run(tight, [("ok", list(range(50)), SamplingParams(max_tokens=5, temperature=0.0))])["ok"]
    with pytest.raises(ValueError, match="chat_kv_cache_memory"):
        LLMEngine(nanochat_model, tokenizer, block_size=8,
                  kv_cache_memory=KVCache.block_bytes(nanochat_model.config, 8, torch.float32) * 10)


def test_a_window_group_hit_needs_only_the_blocks_its_window_sees():
    """Scheduler._hits on a full-context group and a window of 16 in blocks of 8: the full group needs every block
    of the hit, the window group those from the window's start before the first computed position; a hole there
    shortens the hit to where the window's blocks are whole again."""
    from core.chat.protocol import EngineConfig
    from core.chat.scheduler import Scheduler

    sched = Scheduler(EngineConfig(), 64, 8, (None, 16))
    tokens = list(range(100, 196))                        # 12 blocks
    digests = chain(tokens, 8, [])
    full = sched.pool.allocate(12)
    sched.pool.commit(0, full, digests, 0, 12)
    window = sched.pool.allocate(12)
    sched.pool.commit(1, window, digests, 8, 12)          # the window group keeps only its last four blocks
    h, tables = sched._hits(digests, len(tokens) - 1)
    assert h == 11                                        # at most all but the last token: 11 whole blocks
    assert tables[0] == full[:11]
    assert tables[1] == [SCRATCH] * 8 + window[8:11]      # position 87 sees keys from 71: blocks 8-10
    h, tables = sched._hits(digests + [b"x"], 10**6)
    assert h == 12 and tables[1] == [SCRATCH] * 9 + window[9:12]
    sched.pool._forget(window[10])                        # a hole in the window: no hit reaches past it ...
    h, tables = sched._hits(digests, len(tokens) - 1)
    assert h == 0                                         # ... and before block 8 the window group has nothing


def plain_greedy(model, prompt, n):
    """Greedy tokens from a full forward pass per token: no cache at all."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_window_groups_hold_only_their_window(modern_model, tokenizer):
    """The current architecture (SSSL, window 16) in blocks of 8: while a sequence runs 150 positions, each window
    group holds at most the 2 blocks its window spans and the one being filled, the full-context group every
    block; the tokens are those of a plain forward pass per token."""
    engine = LLMEngine(modern_model, tokenizer, max_rows=1, block_size=8, prefix_caching=False)
    windows = engine.cache.groups.windows
    assert None in windows and 16 in windows
    prompt = list(range(60, 100))
    engine.add_request(prompt, SamplingParams(max_tokens=110, temperature=0.0, ignore_eos=True), "long")
    got, most = [], 0
    while engine.has_work():
        for ev in engine.step():
            if ev.token is not None:
                got.append(ev.token)
        for req in engine.scheduler.running:
            s = req.samples[0]
            for w, table in zip(windows, s.tables):
                held = sum(b != SCRATCH for b in table)
                if w is None:
                    assert held == len(table) == -(-s.position // 8) or held == len(table)
                else:
                    most = max(most, held)
                    assert held <= 16 // 8 + 1 + (s.position % 8 == 0), (s.position, table)
    assert most >= 2
    assert got == plain_greedy(modern_model, prompt, 110)


def test_a_window_hit_reads_nothing_the_window_has_left(modern_model, tokenizer):
    """A second prompt that shares 96 of the first's tokens hits them; the window groups' blocks before its
    window, poisoned with NaN, change nothing it computes (it equals the engine without a cache)."""
    on = LLMEngine(modern_model, tokenizer, max_rows=1, block_size=8)
    off = LLMEngine(modern_model, tokenizer, max_rows=1, block_size=8, prefix_caching=False)
    rng = random.Random(8)
    first = [rng.randrange(500) for _ in range(100)]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    run(on, [("a", first, params)])
    second = first[:96] + [rng.randrange(500) for _ in range(6)]
    digests = chain(second, 8, [])
    pool, groups = on.scheduler.pool, on.cache.groups
    poisoned = 0
    for g, w in enumerate(groups.windows):
        if w is None:
            continue
        for d in digests[:(96 - 1 - w) // 8]:            # blocks no query of the second prompt's window sees
            b = pool.cached(g, d)
            if b is not None:
                on.cache.k[:, b] = float("nan")
                on.cache.v[:, b] = float("nan")
                poisoned += 1
    assert poisoned > 0
    events = []
    on.add_request(second, params, "b")
    while on.has_work():
        events += on.step()
    assert events[0].cached_tokens == 96
    assert {"b": {0: [ev.token for ev in events if ev.token is not None]}} == run(off, [("b", second, params)])


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
