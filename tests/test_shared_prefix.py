"""Shared prefixes read once: the decode kernel's groups (cascade attention) over entries whose block tables
begin alike, and the scheduler's wait for a prefix being prefilled. Each against the plain path."""
import contextlib
import random

import pytest
import torch

from core.chat import LLMEngine, SamplingParams
from core.chat.attention import kernel
from core.chat.kv_cache import find_shared_prefixes
from tests.conftest import tiny_model
from tests.test_chat_engine import collect

NONE = torch.empty(0, dtype=torch.long)


@contextlib.contextmanager
def spied(owner, **records):
    """owner.kernel (a module's kernel getter) replaced, inside, by one whose functions named in `records` call
    records[name](args) before the real one; everything else passes through."""
    original = owner.kernel
    real = original()

    class Spy:
        def __getattr__(self, name):
            if name not in records:
                return getattr(real, name)
            fn = getattr(real, name)
            return lambda *args: records[name](args) or fn(*args)

    spy = Spy()
    owner.kernel = lambda: spy
    try:
        yield
    finally:
        owner.kernel = original


def kernel_calls(record):
    """attention.py's kernel, with record(args) called before each decode_attention call (attention.py calls
    kernel() for every decode pass)."""
    import core.chat.attention as attention

    return spied(attention, decode_attention=record)


def reference(q, K, V, tables, positions, window):
    """float64 attention of each entry over its keys (read through its block table) up to its position (from
    position - window on)."""
    B, H, D = q.shape
    group = H // K.size(1)
    bs = K.size(2)
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        pos = int(positions[b])
        lo = 0 if window < 0 else max(0, pos - window)
        idx = tables[b][:pos // bs + 1]
        keys = K[idx].transpose(0, 1).reshape(K.size(1), -1, D)[:, lo:pos + 1]
        values = V[idx].transpose(0, 1).reshape(K.size(1), -1, D)[:, lo:pos + 1]
        k = keys.double().repeat_interleave(group, 0)
        v = values.double().repeat_interleave(group, 0)
        w = torch.softmax(q[b].double()[:, None] @ k.transpose(1, 2) * D ** -0.5, dim=-1)
        out[b] = (w @ v)[:, 0]
    return out


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_entries_read_the_shared_blocks_once_with_the_same_bits(dtype, block_size):
    """Entries whose tables begin with the same blocks, grouped (the leader's table longer or shorter, positions
    inside and at the end of a block, a group of one, GQA), give exactly the bits they give ungrouped, which match
    float64 attention; a windowed layer ignores the groups. Tables list blocks out of order, as a pool hands them."""
    mod = kernel()
    assert mod is not None
    g = torch.Generator().manual_seed(0)
    N, Hkv, D, H, bs = 400, 2, 32, 4, block_size
    K = torch.randn(N, Hkv, bs, D, generator=g).to(dtype)
    V = torch.randn(N, Hkv, bs, D, generator=g).to(dtype)
    order = torch.randperm(N - 1, generator=g).add(1).tolist()
    width = 520 // bs

    def table(prefix):
        return prefix + [order.pop() for _ in range(width - len(prefix))]

    a = table([])
    b = table([])
    positions = torch.tensor([310, 401, 299, 350, 150, 120, 77, 500])
    n_a, n_b = 288 // bs, 96 // bs
    tables = [table(a[:n_a]), table(a[:n_a]), table(a[:n_a]), table(a[:n_a]), table(b[:n_b]), b, table([]), a]
    leaders = torch.tensor([7, 7, 7, 7, 5, 5, 6, 7])
    shared = torch.tensor([n_a * bs] * 4 + [n_b * bs, n_b * bs, 0, n_a * bs])
    T = torch.tensor(tables)
    q = torch.randn(len(tables), H, D, generator=g).to(dtype)
    for window in (-1, 64):
        alone = mod.decode_attention(q, K, V, T, positions, window, D ** -0.5, NONE, NONE)
        grouped = mod.decode_attention(q, K, V, T, positions, window, D ** -0.5, leaders, shared)
        assert torch.equal(alone, grouped)
        err = (grouped.double() - reference(q, K, V, tables, positions, window)).abs().max().item()
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), err
    # a shared prefix must lie within the entry's keys, in the same blocks as its leader's
    with pytest.raises(RuntimeError, match="shared prefix"):
        mod.decode_attention(q, K, V, T, positions, -1, D ** -0.5, leaders, positions + 1)
    with pytest.raises(RuntimeError, match="same blocks"):
        mod.decode_attention(q, K, V, T, positions, -1, D ** -0.5, torch.tensor([6] * 8), shared)


def test_entries_group_on_the_blocks_their_tables_share():
    tables = [[1, 2, 3, 4], [1, 2, 9, 10], [1, 2, 3, 11], [5, 6], [7, 8], [5, 12]]
    positions = [60, 40, 50, 20, 30, 3]
    leaders, shared = find_shared_prefixes(tables, positions, 16)
    # entries 0-2 share blocks 1 and 2 (32 keys); entry 5 is too short to read a shared block, so 3 is alone
    assert leaders[:3] == [0, 0, 0] and shared[:3] == [32, 32, 32]
    assert shared[3:] == [0, 0, 0]
    assert find_shared_prefixes([[1, 2], [3, 4]], [30, 30], 16) is None
    assert find_shared_prefixes([[1, 2], [1, 4]], [30, 10], 16) is None     # below one whole block


def shared_prefix_requests(seed: int, vocab: int = 500):
    """Requests over three system prompts (a prefix_repetition workload), greedy and seeded, some with n > 1 and
    logprobs, then a second wave that finds the prompts cached."""
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab) for _ in range(rng.randint(70, 130))] for _ in range(3)]
    waves = []
    for w in range(2):
        wave = []
        for i in range(9):
            prompt = systems[i % 3] + [rng.randrange(vocab) for _ in range(rng.randint(3, 20))]
            params = SamplingParams(max_tokens=16, temperature=0.0 if i % 2 else 1.0, seed=i, n=1 + (i % 4 == 0),
                                    logprobs=2 if i % 3 == 0 else None, ignore_eos=True)
            wave.append((f"w{w}r{i}", prompt, params))
        waves.append(wave)
    return waves


def stack_calls(record):
    """decode_stack.py's kernel for the engines built inside, with record(lengths) called before each call of the
    blocks, `lengths` each layer group's shared-prefix lengths (rows that read a shared prefix: > 0)."""
    from core.chat import decode_stack

    return spied(decode_stack, gpt2_blocks=lambda args: record([args[8]]),
                 nanochat_blocks=lambda args: record(args[13]))


@pytest.mark.parametrize("fused", [True, False], ids=["stack", "modules"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["nanochat", "modern", "gpt2"])
def test_shared_prefix_attention_changes_no_token_or_logprob(arch, tokenizer, dtype, fused):
    """An engine that reads shared prefixes once and one that does not give the same tokens and logprobs, in fp32
    and bf16 alike, with the decode stack (which takes a small fp32 model's passes of up to 64 rows, bf16's of
    two) and without it; the first did group rows (a build or a bookkeeping fault that never groups fails
    here), in the attention kernel's calls or the stack's."""
    model = tiny_model(arch, tokenizer, seed=4, std=0.3).to(dtype)
    grouped = []
    results = {}
    for name, sharing in (("on", True), ("off", False)):
        def record(lengths, name=name):
            grouped.append((name, max([int((t > 0).sum()) for t in lengths], default=0)))

        with stack_calls(record):
            engine = LLMEngine(model, tokenizer, max_rows=12, prefill_chunk=64, shared_prefix_attention=sharing,
                               fused_decode=fused)
        assert engine.shared_prefixes is sharing and (engine.decode_stack is not None) is fused
        with kernel_calls(lambda args, name=name: grouped.append((name, int((args[-1] > 0).sum())))):
            out = {}
            for wave in shared_prefix_requests(seed=5):
                for rid, prompt, params in wave:
                    engine.add_request(prompt, params, rid)
                while engine.has_work():
                    for ev in engine.step():
                        if ev.token is not None:
                            out.setdefault((ev.request_id, ev.index), []).append((ev.token, ev.logprob,
                                                                                  ev.top_logprobs))
            results[name] = out
    assert results["on"] == results["off"]
    # several rows read one system prompt together in some decode steps; never with the option off
    assert max(n for name, n in grouped if name == "on") >= 4
    assert max(n for name, n in grouped if name == "off") == 0


def test_a_burst_with_one_system_prompt_computes_it_once(tokenizer, nanochat_model):
    """Eight prompts with one 96-token system prompt, arriving together: the first computes it, the others wait
    until it is in its row, copy it, and generate what they generate without the cache; they are admitted in
    arrival order."""
    rng = random.Random(3)
    system = [rng.randrange(500) for _ in range(96)]
    reqs = [(f"r{i}", system + [rng.randrange(500) for _ in range(5 + i)], SamplingParams(max_tokens=6, temperature=0))
            for i in range(8)]
    on = LLMEngine(nanochat_model, tokenizer, max_rows=8)
    off = LLMEngine(nanochat_model, tokenizer, max_rows=8, prefix_caching=False)
    results = []
    for engine in (on, off):
        for rid, prompt, params in reqs:
            engine.add_request(prompt, params, rid)
        admitted = []
        admit = engine.scheduler.admit

        def spy():
            out = admit()
            admitted.extend(a.request.id for a in out)
            return out

        engine.scheduler.admit = spy
        results.append(collect(engine))
        assert admitted == [rid for rid, _, _ in reqs]
    assert results[0] == results[1]
    assert on.stats().prefix_hit_tokens >= 7 * 96


def test_attention_on_more_threads_than_the_model_changes_nothing(tokenizer, modern_model):
    """attention_threads: the decode kernel and prefill's SDPA run on that many torch threads (the rest of the
    model on its own count), with the same tokens as on one, the blocks run as modules (where the kernel's calls
    are seen here) or as decode_stack.py's one call (which sets the threads in C++)."""
    from core.chat.protocol import EngineConfig

    with pytest.raises(ValueError, match="attention_threads"):
        EngineConfig(attention_threads=0)
    seen = []
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    results = []
    try:
        for n, fused in ((None, False), (2, False), (2, True)):
            engine = LLMEngine(modern_model, tokenizer, max_rows=6, prefill_chunk=48, attention_threads=n,
                               fused_decode=fused)
            assert engine.fused_decode is fused
            seen.clear()
            with kernel_calls(lambda args: seen.append(torch.get_num_threads())):
                for wave in shared_prefix_requests(seed=7):
                    for rid, prompt, params in wave[:5]:
                        engine.add_request(prompt, params, rid)
                results.append(collect(engine))
            # (with the stack, only passes of more rows than it takes run the modules, where calls are seen)
            assert (set(seen) <= {n} if fused else set(seen) == {n or 1}) and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert results[0] == results[1] == results[2]
