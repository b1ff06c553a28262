"""The decode stack (core/chat/decode_stack.py): a decode step's blocks in one C++ call, against the model's
own modules on the same cache, and through the engine."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_model
from core.chat import decode_stack
from core.chat.engine import LLMEngine
from core.chat.kv_cache import CacheBatch, KVCache
from core.chat.model import GPT2Block
from core.chat.protocol import SamplingParams
from core.chat.quantized import quantize_linears

pytestmark = pytest.mark.skipif(decode_stack.kernel() is None, reason="the decode stack cannot be built here")

BS = 16


def run(model, fused: bool, steps: int = 6, dtype=torch.float32, rows=(0, 1, 2)):
    """Entries 0 and 1 share a 32-token prompt (in every layer group entry 1's table begins with entry 0's blocks:
    the kernel's shared-prefix attention), entry 2 has a 21-token prompt of its own; then `steps` decode passes of
    the entries in `rows`, each fed its own greedy token -> the decode passes' logits (steps, len(rows), V)."""
    cache = KVCache.for_model(model.config, 64, BS, dtype=dtype)
    stack = decode_stack.prepare(model, cache) if fused else None
    assert (stack is not None) == fused
    g = torch.Generator().manual_seed(4)
    shared, own = torch.randint(3, 500, (32,), generator=g), torch.randint(3, 500, (21,), generator=g)
    free = iter(range(1, 64))
    tables = {0: [], 1: [], 2: []}
    for _ in range(len(cache.groups)):
        a, b = next(free), next(free)
        tables[0].append([a, b, next(free), next(free)])
        tables[1].append([a, b, next(free), next(free)])
        tables[2].append([next(free) for _ in range(4)])
    with torch.no_grad():
        model(shared[None], CacheBatch.build(cache, [tables[0]], [0], 32))
        model(own[None], CacheBatch.build(cache, [tables[2]], [0], 21))
        pos = {0: 32, 1: 32, 2: 21}
        token = {0: torch.tensor(7), 1: torch.tensor(9), 2: torch.tensor(11)}
        before = {0: int(shared[-1]), 1: int(shared[-1]), 2: int(own[-1])}
        out = []
        for _ in range(steps):
            ids = torch.stack([token[r] for r in rows])[:, None]
            previous = [before[r] for r in rows] if model.needs_previous else None
            cb = CacheBatch.build(cache, [tables[r] for r in rows], [pos[r] for r in rows], 1, previous,
                                  shared_prefixes=True, fused=stack)
            logits = model(ids, cb, last=torch.zeros(len(rows), dtype=torch.long))
            out.append(logits)
            for i, r in enumerate(rows):
                before[r], token[r], pos[r] = int(token[r]), logits[i].argmax(), pos[r] + 1
    return torch.stack(out)


def run_many(model, fused: bool, n: int, steps: int = 4, threads: int = 0):
    """`n` entries with prompts of their own (9 to 9 + n - 1 tokens), then `steps` decode passes of all of them
    (on `threads` torch threads, if given), each fed its own greedy token -> the passes' logits (steps, n, V)."""
    cache = KVCache.for_model(model.config, 2 * n * len(KVCache.for_model(model.config, 1, BS).groups) + 1, BS)
    stack = decode_stack.prepare(model, cache) if fused else None
    g = torch.Generator().manual_seed(6)
    free = iter(range(1, 1 << 20))
    tables = [[[next(free), next(free)] for _ in range(len(cache.groups))] for _ in range(n)]
    prompts = [torch.randint(3, 500, (9 + i,), generator=g) for i in range(n)]
    with torch.no_grad():
        for i, p in enumerate(prompts):
            model(p[None], CacheBatch.build(cache, [tables[i]], [0], len(p)))
        pos = [len(p) for p in prompts]
        token, before = [torch.tensor(5 + i) for i in range(n)], [int(p[-1]) for p in prompts]
        out, was = [], torch.get_num_threads()
        torch.set_num_threads(threads or was)
        try:
            for _ in range(steps):
                cb = CacheBatch.build(cache, tables, pos, 1, before if model.needs_previous else None, fused=stack)
                logits = model(torch.stack(token)[:, None], cb, last=torch.zeros(n, dtype=torch.long))
                out.append(logits)
                for i in range(n):
                    before[i], token[i], pos[i] = int(token[i]), logits[i].argmax(), pos[i] + 1
        finally:
            torch.set_num_threads(was)
    return torch.stack(out)


def build(arch, tokenizer, dtype=torch.float32, weights="dtype", **kw):
    model = tiny_model(arch, tokenizer, seed=5, std=0.3, **kw)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():       # biases and LayerNorm gains of their own (init_weights makes them 0 and 1)
        for name, p in model.named_parameters():
            if name.endswith("bias") or (name.endswith("weight") and p.dim() == 1):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    model = model.to(dtype)
    if weights == "int8":
        quantize_linears(model)
    return model


def gpt2(tokenizer, dtype=torch.float32, weights="dtype", **kw):
    return build("gpt2", tokenizer, dtype, weights, **kw)


ARCHS = [("gpt2", {}), ("gpt2", {"gelu_approximate": "tanh"}), ("nanochat", {}), ("modern", {})]
ARCH_IDS = ["gpt2", "gpt2-tanh", "nanochat-release", "nanochat-current"]


@pytest.mark.parametrize("weights", ["dtype", "int8"])
@pytest.mark.parametrize("arch,kw", ARCHS, ids=ARCH_IDS)
def test_the_stack_computes_what_the_modules_do_in_fp32(tokenizer, arch, kw, weights):
    """fp32 (weights as they are or int8): one, two and three entries at once (two of them with a shared prefix)
    decode six steps through the stack and through the modules, each on a cache of its own that its own passes
    wrote: the same logits within 1e-5 of their spread. nanochat's current architecture brings sliding windows
    (several layer groups), value embeddings, the residual scalars, smear and backout; both nanochat's GQA."""
    model = build(arch, tokenizer, weights=weights, **kw)
    for rows in [(0, 1, 2), (0, 1), (2,)]:
        want, got = run(model, False, rows=rows), run(model, True, rows=rows)
        spread = (want.amax(-1) - want.amin(-1)).max()
        assert (got - want).abs().max() <= 1e-5 * spread
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("weights", ["dtype", "int8"])
@pytest.mark.parametrize("arch", ["gpt2", "nanochat", "modern"])
def test_the_stack_rounds_as_the_modules_do_in_bf16(tokenizer, arch, weights):
    """bf16: the stack rounds each value where torch's ops round it, so its logits stay near the modules' (their
    products' sums may run in other orders; on the AMD EPYC with AVX2 the two were identical for all three
    architectures), and the greedy tokens agree. Kept in fp32 instead of rounded, the GPT-2 stack was 0.8-0.9% of
    the spread away (2026-12-07)."""
    model = build(arch, tokenizer, torch.bfloat16, weights)
    want, got = run(model, False, dtype=torch.bfloat16, rows=(0, 1)), run(model, True, dtype=torch.bfloat16, rows=(0, 1))
    spread = (want.amax(-1) - want.amin(-1)).max()
    assert (got - want).abs().max() <= 0.005 * spread
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("rows", [8, 12, 20])
@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_a_small_fp32_model_takes_the_stack_at_many_rows(tokenizer, arch, rows):
    """fp32 weights left unpacked (a small model's): the stack runs passes of up to decode_stack.MAX_ROWS rows,
    eight rows a kernel pass and torch's product beyond eight, and computes what the modules do (within 1e-5 of
    the logits' spread), greedy tokens equal."""
    model = build(arch, tokenizer)
    assert decode_stack.weights_kind(model) == "dtype"
    assert decode_stack.prepare(model, KVCache.for_model(model.config, 8, BS)).rows == decode_stack.MAX_ROWS
    want, got = run_many(model, False, rows), run_many(model, True, rows)
    spread = (want.max() - want.min()).item()
    assert (got - want).abs().max().item() <= 1e-5 * spread
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("weights,rows", [("dtype", 20), ("int8", 8)])
def test_the_stack_computes_the_same_bits_on_one_thread_as_on_two(tokenizer, weights, rows):
    """The stack splits its products and attention into items that either thread may take (the kernel's column
    blocks, a single-threaded BLAS call per block beyond eight rows, attention's (group, head) items), so its
    output (after the final norm; the tiny head is torch's product) is the same bit for bit on one thread as on
    two: 20 rows of fp32 weights (BLAS), 8 of int8 (the kernel)."""
    model = build("gpt2", tokenizer, weights=weights)
    model.logits = lambda x: x.float()
    assert decode_stack.prepare(model, KVCache.for_model(model.config, 8, BS)).rows >= rows
    assert torch.equal(run_many(model, True, rows, threads=1), run_many(model, True, rows, threads=2))


def test_packed_and_int8_weights_keep_the_stack_to_few_rows(tokenizer, monkeypatch):
    """Where packed.py packs the blocks' layers for oneDNN, an fp32 pass of more than four rows runs the modules
    (oneDNN's packed product is as fast there); int8 weights take the stack up to eight rows."""
    from core.chat.packed import available, pack_linears

    if not available():
        pytest.skip("torch without oneDNN")
    calls = []
    forward = GPT2Block.forward
    monkeypatch.setattr(GPT2Block, "forward", lambda self, *a: calls.append(1) or forward(self, *a))
    model = gpt2(tokenizer)
    pack_linears(model, min_weight=0)
    assert decode_stack.weights_kind(model) == "packed"
    assert decode_stack.prepare(model, KVCache.for_model(model.config, 8, BS)).rows == 4
    run_many(model, True, 4, steps=2)
    assert len(calls) == 4 * 2                     # four prefills of two blocks; the decode passes: the stack
    calls.clear()
    run_many(model, True, 5, steps=2)
    assert len(calls) == 5 * 2 + 2 * 2             # five rows: the modules
    int8 = gpt2(tokenizer, weights="int8")
    assert decode_stack.weights_kind(int8) == "int8"
    assert decode_stack.prepare(int8, KVCache.for_model(int8.config, 8, BS)).rows == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_a_row_computes_the_same_bits_alone_as_in_a_batch(tokenizer, arch, dtype):
    """The stack's output (after the final norm: the tiny head here is MKL's product, which is not) for a row
    alone and beside others, bit for bit."""
    model = build(arch, tokenizer, dtype)
    model.logits = lambda x: x.float()
    rows = (0, 1, 2) if decode_stack.ROWS[dtype, "dtype"] >= 3 else (1, 2)
    together = run(model, True, dtype=dtype, rows=rows)
    for i, r in enumerate(rows):
        assert torch.equal(together[:, i], run(model, True, dtype=dtype, rows=(r,))[:, 0])


def test_the_stack_replaces_the_blocks_and_the_modules_run_otherwise(tokenizer, monkeypatch):
    """A decode pass of up to the stack's rows (a small fp32 model: 64, bf16: 2) given the stack calls no block
    module; more rows, a prefill and a pass without it run the modules; a model with a layer the stack cannot
    read, or a cache of another dtype, gets none."""
    calls = []
    forward = GPT2Block.forward
    monkeypatch.setattr(GPT2Block, "forward", lambda self, *a: calls.append(1) or forward(self, *a))
    model = gpt2(tokenizer)
    run(model, True, steps=2, rows=(0, 1, 2))
    assert calls == [1] * 2 * 2                    # the two prefills only (two blocks each)
    calls.clear()
    run(model, False, steps=2, rows=(0,))
    assert len(calls) == 2 * 2 + 2 * 2             # prefills, then the decode passes: the modules
    calls.clear()
    run(gpt2(tokenizer, torch.bfloat16), True, steps=2, rows=(0, 1, 2), dtype=torch.bfloat16)
    assert len(calls) == 2 * 2 + 2 * 2             # bf16 at three rows: the modules
    model.transformer.h[1].mlp["c_fc"] = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(64, 256))
    assert decode_stack.prepare(model, KVCache.for_model(model.config, 8, BS)) is None   # a weight it cannot read
    assert decode_stack.prepare(model.to(torch.bfloat16), KVCache.for_model(model.config, 8, BS)) is None  # dtypes


@pytest.mark.parametrize("streams", [2, 4, 12])
@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_the_engine_decodes_through_the_stack_with_the_same_tokens(tokenizer, arch, streams):
    """The engine takes the stack on the CPU (EngineConfig.fused_decode) unless it is switched off, and a few
    streams generate the same greedy tokens either way."""
    from tests.test_chat_engine import collect, prompts

    outs = []
    for fused in (True, False):
        engine = LLMEngine(build(arch, tokenizer), tokenizer, max_rows=16, fused_decode=fused)
        assert engine.fused_decode is fused
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts(streams, seed=3)):
            engine.add_request(p, params, f"r{i}")
        outs.append({rid: out[0] for rid, out in collect(engine).items()})
    assert outs[0] == outs[1]
