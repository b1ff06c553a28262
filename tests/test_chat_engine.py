"""Continuous batching: batched runs against single-request runs, seeds, cancellation, tools, stop strings."""
import asyncio

import pytest
import torch

from core.chat import EngineError, EngineFull, LLMEngine, SamplingParams
from core.chat.async_engine import ThreadEngine
from core.chat.packed import packs
from tests.conftest import tiny_model


def run_alone(model, tokenizer, prompt, params):
    engine = LLMEngine(model, tokenizer, max_rows=params.n)
    engine.add_request(prompt, params, "solo")
    return collect(engine)["solo"]


def collect(engine, on_step=None):
    """Run the engine dry; -> {request_id: {sample_index: [tokens]}} (terminal tokens included)."""
    out = {}
    step = 0
    while engine.has_work():
        if on_step:
            on_step(step, engine)
        for ev in engine.step():
            if ev.token is not None:
                out.setdefault(ev.request_id, {}).setdefault(ev.index, []).append(ev.token)
        step += 1
    return out


def prompts(n, seed=0, vocab=500):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(3, 60, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_greedy_joining_at_different_steps_equals_alone(any_nanochat, tokenizer):
    """8 prompts of different lengths, added at different steps, chunked prefill: each equals its solo run."""
    params = SamplingParams(max_tokens=24, temperature=0.0)
    ps = prompts(8)
    solo = {f"r{i}": run_alone(any_nanochat, tokenizer, p, params) for i, p in enumerate(ps)}
    engine = LLMEngine(any_nanochat, tokenizer, max_rows=5, prefill_chunk=40, block_size=4)

    def add(step, eng):
        for i, p in enumerate(ps):
            if step == 3 * i:
                eng.add_request(p, params, f"r{i}")

    add(0, engine)
    batched = collect(engine, on_step=lambda s, e: add(s + 1, e) if s + 1 <= 21 else None)
    assert batched == solo
    assert all(len(v[0]) >= 1 for v in solo.values())


@pytest.mark.parametrize("top_k,top_p", [(None, 1.0), (20, 1.0), (None, 0.8), (50, 0.9)])
def test_seeded_sampling_same_alone_and_batched(nanochat_model, tokenizer, top_k, top_p):
    ps = prompts(4, seed=1)
    params = [SamplingParams(max_tokens=20, temperature=1.0, top_k=top_k, top_p=top_p, seed=100 + i) for i in range(4)]
    solo = [run_alone(nanochat_model, tokenizer, p, sp) for p, sp in zip(ps, params)]
    engine = LLMEngine(nanochat_model, tokenizer, max_rows=8)
    for i, (p, sp) in enumerate(zip(ps, params)):
        engine.add_request(p, sp, f"r{i}")
    # unrelated, unseeded traffic in the same batch, with filters of its own (a row's token must not depend on
    # whether its batch mates filter)
    engine.add_request(ps[0], SamplingParams(max_tokens=20, temperature=1.0, top_k=5, top_p=0.5), "noise")
    batched = collect(engine)
    assert [batched[f"r{i}"] for i in range(4)] == solo


def test_first_tokens_are_emitted_before_the_decode_pass(nanochat_model, tokenizer):
    """step(emit=...) hands a new request's first token over before the running rows' decode pass; the tokens
    are the same as without emit."""
    params = SamplingParams(max_tokens=12, temperature=0.0)
    a, b = prompts(2, seed=3)
    runs = []
    for use_emit in (False, True):
        engine = LLMEngine(nanochat_model, tokenizer, max_rows=2)
        engine.add_request(a, params, "a")
        engine.step()                    # a: prefilled, first token out; it decodes from now on
        engine.add_request(b, params, "b")
        emitted = []
        returned = engine.step(emit=emitted.extend) if use_emit else engine.step()
        if use_emit:
            assert [(ev.request_id, ev.index) for ev in emitted] == [("b", 0)]
            assert {ev.request_id for ev in returned} == {"a"}
        runs.append([(ev.request_id, ev.token) for ev in emitted + returned]
                    + [(ev.request_id, ev.token) for _ in range(40) for ev in engine.step()])
    assert runs[0] == runs[1]


def test_n_samples_share_prefill_and_differ(nanochat_model, tokenizer):
    p = prompts(1, seed=2)[0]
    out = run_alone(nanochat_model, tokenizer, p, SamplingParams(max_tokens=12, temperature=1.5, seed=7, n=4))
    firsts = {tuple(v[:1]) for v in out.values()}
    assert len(out) == 4
    assert len({tuple(v) for v in out.values()}) > 1
    assert len(firsts) > 1, "each sample must draw its own first token"


def test_cancel_frees_rows_for_waiting_request(nanochat_model, tokenizer):
    engine = LLMEngine(nanochat_model, tokenizer, max_rows=2)
    long = SamplingParams(max_tokens=200, temperature=0.0)
    engine.add_request([1, 2, 3], long, "a")
    engine.add_request([4, 5, 6], long, "b")
    engine.add_request([7, 8, 9], SamplingParams(max_tokens=3, temperature=0.0), "waiter")
    for _ in range(3):
        engine.step()
    assert engine.stats().waiting == 1 and engine.stats().rows_used == 2
    engine.abort("a")
    events = engine.step()
    assert any(ev.request_id == "a" and ev.finish_reason == "abort" for ev in events)
    seen = []
    for _ in range(5):
        seen += engine.step()
    assert any(ev.request_id == "waiter" and ev.token is not None for ev in seen)


def test_bounded_queue_and_bad_requests(nanochat_model, tokenizer):
    engine = LLMEngine(nanochat_model, tokenizer, max_rows=2, max_waiting=2)
    engine.add_request([1], SamplingParams(), "x")
    engine.add_request([1], SamplingParams(), "y")
    with pytest.raises(EngineFull):
        engine.add_request([1], SamplingParams(), "z")
    with pytest.raises(EngineError, match="n=3"):
        LLMEngine(nanochat_model, tokenizer, max_rows=2).add_request([1], SamplingParams(n=3))
    with pytest.raises(EngineError, match="context"):
        engine.add_request([1] * 300, SamplingParams())


def test_generation_runs_to_sequence_len(nanochat_model, tokenizer):
    """A request that reaches the context end stops with 'length', and its tokens equal an uncached greedy run."""
    p = prompts(1, seed=3)[0][:10]
    model = tiny_model("nanochat", tokenizer)
    with torch.no_grad():   # never predict a special token, so the run must reach the end of the context
        model.lm_head.weight[min(tokenizer.special_tokens.values()):] = 0.0
    nanochat_model = model
    engine = LLMEngine(model, tokenizer, max_rows=1, block_size=4)
    engine.add_request(p, SamplingParams(max_tokens=1000, temperature=0.0), "r")
    events = [ev for _ in range(400) for ev in engine.step()]
    finish = [ev.finish_reason for ev in events if ev.finish_reason]
    toks = [ev.token for ev in events if ev.token is not None]
    assert finish == ["length"]
    assert len(p) + len(toks) == nanochat_model.config.sequence_len
    ids = list(p)
    with torch.no_grad():
        for tok in toks:
            assert nanochat_model(torch.tensor([ids]))[0, -1].argmax().item() == tok
            ids.append(tok)


def test_async_engine_streams_and_aborts(nanochat_model, tokenizer):
    engine = LLMEngine(nanochat_model, tokenizer, max_rows=1)
    aengine = ThreadEngine(engine)

    async def main():
        agen = aengine.generate([1, 2, 3], SamplingParams(max_tokens=200, temperature=0.0))
        got = 0
        async for batch in agen:
            got += len(batch)
            if got >= 3:
                break
        await agen.aclose()
        # the one row is freed, so a second request completes
        events = [ev async for batch in aengine.generate([4, 5], SamplingParams(max_tokens=4, temperature=0.0))
                  for ev in batch]
        return got, events

    try:
        got, events = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        aengine.shutdown()
    assert got >= 3
    assert events[-1].finish_reason in ("length", "stop")
    assert [ev.token for ev in events if ev.token is not None] == \
        run_alone(nanochat_model, tokenizer, [4, 5], SamplingParams(max_tokens=4, temperature=0.0))[0]


class ScriptedModel(torch.nn.Module):
    """A stand-in model that emits a fixed token script (greedy), for tool and stop-string tests."""

    needs_previous = False      # it reads no previous token (ChatNetwork.needs_previous)

    def __init__(self, config, script):
        super().__init__()
        self.config, self.script = config, script
        self.w = torch.nn.Parameter(torch.zeros(1))

    def get_device(self):
        return torch.device("cpu")

    def forward(self, ids, cache=None, last=None):
        B = ids.size(0)
        pos = cache.positions[torch.arange(B), last] if cache is not None else torch.full((B,), ids.size(1) - 1)
        logits = torch.zeros(B, self.config.vocab_size)
        for b in range(B):
            k = int(pos[b]) + 1 - self.prompt_len
            logits[b, self.script[min(k, len(self.script) - 1)]] = 10.0
        return logits


def scripted_engine(tokenizer, text_parts, prompt_len=3):
    from tests.conftest import tiny_config

    script = []
    for kind, text in text_parts:
        if kind == "special":
            script.append(tokenizer.encode_special(text))
        else:
            script += tokenizer.encode(text)
    model = ScriptedModel(tiny_config("nanochat", tokenizer), script)
    model.prompt_len = prompt_len
    return LLMEngine(model, tokenizer, max_rows=2), script


def test_calculator_output_is_forced(tokenizer):
    parts = [("text", "the answer is"), ("special", "<|python_start|>"), ("text", "12*(3+4)"),
             ("special", "<|python_end|>"), ("text", " ok"), ("text", " ok"), ("text", " ok"), ("text", " ok"),
             ("text", " ok"), ("text", " ok"), ("special", "<|assistant_end|>")]
    engine, _ = scripted_engine(tokenizer, parts)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=60, temperature=0.0), "r")
    events = [ev for _ in range(80) for ev in engine.step()]
    out = "".join(ev.text for ev in events if ev.segment == "python_output")
    expr = "".join(ev.text for ev in events if ev.segment == "python")
    assert expr == "12*(3+4)" and out == "84"
    forced = [ev.token for ev in events if ev.forced]
    t = tokenizer.encode_special
    assert forced[0] == t("<|output_start|>") and forced[-1] == t("<|output_end|>")
    assert tokenizer.decode(forced[1:-1]) == "84"


def test_stop_string_is_cut_and_held_back(tokenizer):
    parts = [("text", "hello how are you the cat sat"), ("special", "<|assistant_end|>")]
    engine, _ = scripted_engine(tokenizer, parts)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=60, temperature=0.0, stop=["are you"]), "r")
    events = [ev for _ in range(40) for ev in engine.step()]
    text = "".join(ev.text for ev in events)
    assert text == "hello how "
    assert events[-1].finish_reason == "stop"


def test_multibyte_character_streams_whole(tokenizer):
    # byte-level tokens: split a multi-byte character across tokens on purpose
    char = "日"
    raw = char.encode()
    byte_tokens = [tokenizer.enc.encode_single_token(bytes([b])) for b in raw]
    dec = tokenizer.stream_decoder()
    deltas = [dec.feed(t) for t in byte_tokens]
    assert deltas[:-1] == ["", ""] and deltas[-1] == char
    dec.feed(byte_tokens[0])
    assert dec.flush() == ""    # an incomplete tail is dropped at the end
    dec2 = tokenizer.stream_decoder()
    text = "".join(dec2.feed(t) for t in tokenizer.encode("café 😀 日本語")) + dec2.flush()
    assert text == "café 😀 日本語"


def test_ignore_eos_runs_to_max_tokens(tokenizer):
    parts = [("text", "hello how are you"), ("special", "<|assistant_end|>")]
    engine, script = scripted_engine(tokenizer, parts)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=12, temperature=0.0), "stops")
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), "runs")
    events = [ev for _ in range(30) for ev in engine.step()]
    by = {rid: [ev for ev in events if ev.request_id == rid] for rid in ("stops", "runs")}
    assert by["stops"][-1].finish_reason == "stop" and by["stops"][-1].completion_tokens == len(script)
    assert by["runs"][-1].finish_reason == "length" and by["runs"][-1].completion_tokens == 12
    # the same text either way: the end-of-turn tokens it ran past count, but show nothing
    assert "".join(ev.text for ev in by["runs"]) == "".join(ev.text for ev in by["stops"]) == "hello how are you"


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["nanochat", "modern", "gpt2"])
def test_cuda_graph_decode_matches_eager(arch, tokenizer):
    """Decode passes replayed from CUDA graphs (padded batch, bucketed key length, scratch row) give the same
    tokens as eager passes (fp32 on CUDA, so only summation order can differ), for greedy and seeded sampling,
    with requests of different lengths joining and leaving."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = tiny_model(arch, tokenizer, seed=2, sequence_len=300).to("cuda")
    ps = prompts(6, seed=5)
    params = [SamplingParams(max_tokens=8 + 25 * (i % 3), temperature=0.0 if i % 2 else 1.0, seed=i, n=1 + (i == 4))
              for i in range(6)]
    runs = {}
    for graphs in (True, False):
        engine = LLMEngine(model, tokenizer, max_rows=5, cuda_graphs=graphs)
        assert (engine.graphs is not None) == graphs
        for i in range(3):
            engine.add_request(ps[i], params[i], f"r{i}")
        runs[graphs] = collect(engine, on_step=lambda s, e: [e.add_request(ps[i], params[i], f"r{i}")
                                                             for i in range(3, 6) if s == 4 + i])
        if graphs:
            assert len(engine.graphs.graphs) >= 2     # more than one batch bucket was recorded and replayed
    assert runs[True] == runs[False]
    assert sorted(runs[True]) == [f"r{i}" for i in range(6)] and len(runs[True]["r4"]) == 2


def test_failed_graph_recording_falls_back_to_eager(nanochat_model, tokenizer, caplog):
    """If recording a decode graph fails, the engine logs it, turns graphs off and decodes eagerly: same tokens."""
    from core.chat.cuda_graphs import GraphCaptureError

    class Failing:
        calls = 0

        def run(self, tokens, tables, positions, previous):
            Failing.calls += 1
            raise GraphCaptureError("no graphs here")

    params = SamplingParams(max_tokens=12, temperature=1.0, seed=4)
    ps = prompts(3, seed=9)
    runs = []
    for inject in (False, True):
        engine = LLMEngine(nanochat_model, tokenizer, max_rows=3)
        if inject:
            engine.graphs = Failing()
        for i, p in enumerate(ps):
            engine.add_request(p, params, f"r{i}")
        runs.append(collect(engine))
        if inject:
            assert engine.graphs is None
    assert runs[0] == runs[1]
    assert Failing.calls == 1 and "decoding eagerly" in caplog.text


# ---- continuing a generation (a replica was lost mid-stream: another one takes over from the delivered tokens)
def events_of(engine, rid="r", steps=400):
    out = []
    for _ in range(steps):
        if not engine.has_work():
            break
        out += [ev for ev in engine.step() if ev.request_id == rid]
    return out


def shown(events):
    """What a client has seen of a stream: (token, text, segment, forced) per token, the finish, the counts."""
    return ([(ev.token, ev.text, ev.segment, ev.forced) for ev in events],
            [(ev.finish_reason, ev.completion_tokens, ev.prompt_tokens) for ev in events if ev.finish_reason])


def continued(make_engine, prompt, params, full, k, neighbours=()):
    """The stream `full` cut after its k-th token and continued on a fresh engine: what the client sees
    in all (the first k token events, then the continuation)."""
    engine = make_engine()
    for i, p in enumerate(neighbours):       # unrelated traffic in the continuation's batch
        engine.add_request(p, SamplingParams(max_tokens=30, temperature=1.0, top_k=7), f"n{i}")
    delivered = [ev for ev in full if ev.token is not None][:k]
    engine.add_request(prompt, params, "r", resume=[ev.token for ev in delivered])
    rest = events_of(engine)
    assert all(ev.token is None or ev.completion_tokens > k for ev in rest)
    head = full[:full.index(delivered[-1]) + 1]
    return shown(head + rest)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=40, temperature=0.0),
    SamplingParams(max_tokens=40, temperature=0.9, top_k=40, top_p=0.95, seed=7),
    SamplingParams(max_tokens=40, temperature=1.0, seed=3, frequency_penalty=0.8, presence_penalty=0.5,
                   repetition_penalty=1.3, logit_bias={11: 3.0}),
], ids=["greedy", "seeded", "penalties"])
def test_a_continued_generation_is_the_rest_of_the_unbroken_run(any_nanochat, tokenizer, params):
    """Cut anywhere (after the first token, mid-way, one before the end), continued on another engine beside
    other traffic: the client sees exactly the unbroken run's tokens, text and counts."""
    prompt = prompts(1, seed=5)[0]
    make = lambda: LLMEngine(any_nanochat, tokenizer, max_rows=4, prefill_chunk=16)  # noqa: E731
    engine = make()
    engine.add_request(prompt, params, "r")
    full = events_of(engine)
    tokens = [ev.token for ev in full if ev.token is not None]
    assert len(tokens) == 40
    alone = lambda: LLMEngine(any_nanochat, tokenizer, max_rows=1)  # noqa: E731   (one chunk, nobody beside)
    for k in (1, 17, 39):
        assert continued(make, prompt, params, full, k, neighbours=prompts(2, seed=k)) == shown(full), k
        assert continued(alone, prompt, params, full, k) == shown(full), k


def test_a_continuation_resumes_the_tool_and_the_text_state(tokenizer):
    """A stream cut inside a calculator call, inside its forced result, inside a held-back stop-string prefix and
    inside a multi-byte character continues exactly as it would have."""
    parts = [("text", "so 日本"), ("special", "<|python_start|>"), ("text", "12*(3+4)"),
             ("special", "<|python_end|>"), ("text", " ok ok ok ok ok it is are y fine"),
             ("special", "<|assistant_end|>")]       # (the forced result takes the place of a few " ok")
    params = SamplingParams(max_tokens=60, temperature=0.0, stop=["are you"])
    make = lambda: scripted_engine(tokenizer, parts)[0]  # noqa: E731
    engine = make()
    engine.add_request([1, 2, 3], params, "r")
    full = events_of(engine)
    text = "".join(ev.text for ev in full)
    assert "84" in text and "are y fine" in text and full[-1].finish_reason == "stop"
    n = sum(ev.token is not None for ev in full)
    for k in range(1, n - 1):
        assert continued(make, [1, 2, 3], params, full, k) == shown(full), k


def test_a_continuation_that_cannot_be_taken_is_refused(nanochat_model, tokenizer):
    engine = LLMEngine(nanochat_model, tokenizer, max_rows=2)
    end = tokenizer.encode_special("<|assistant_end|>")
    for params, resume in [(SamplingParams(max_tokens=4, n=2), [5]), (SamplingParams(max_tokens=2), [5, 6]),
                           (SamplingParams(max_tokens=8), [5, end]), (SamplingParams(max_tokens=8), [10 ** 9])]:
        with pytest.raises(EngineError):
            engine.add_request([1, 2], params, resume=resume)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["nanochat", "modern", "gpt2"])
def test_engine_runs_its_linear_layers_packed_and_generates_what_torch_linear_does(arch, dtype, tokenizer,
                                                                                   monkeypatch):
    """On the CPU the engine packs its model's large linear layers for oneDNN (here every layer: the tiny
    model's are all under packed.MIN_WEIGHT), in fp32 and in bf16; greedy and seeded streams, batched (products
    of more and of fewer than packed.MIN_ROWS rows as the batch drains), give the tokens of the same model on
    F.linear."""
    import core.chat.packed as packed_module
    from core.chat.packed import PackedLinear

    if dtype == "bfloat16" and not packs(torch.bfloat16):
        pytest.skip("oneDNN does not pack bf16 weights on this CPU")
    monkeypatch.setattr(packed_module, "MIN_WEIGHT", 0)
    fast = tiny_model(arch, tokenizer, seed=6, std=0.3).to(getattr(torch, dtype))
    plain = tiny_model(arch, tokenizer, seed=6, std=0.3).to(getattr(torch, dtype))
    a = LLMEngine(fast, tokenizer, max_rows=8)
    b = LLMEngine(plain, tokenizer, max_rows=8, packed_linear=False)
    assert (a.linear, b.linear) == ("onednn-packed", "torch")
    assert LLMEngine(fast, tokenizer, max_rows=2).linear == "onednn-packed"     # a model packed before
    assert any(isinstance(m, PackedLinear) for m in fast.modules())
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())
    for engine in (a, b):
        for i, p in enumerate(prompts(6, seed=3)):
            params = (SamplingParams(max_tokens=24, temperature=0) if i % 2 else
                      SamplingParams(max_tokens=24, temperature=1.0, seed=40 + i, top_k=20))
            engine.add_request(p, params, f"r{i}")
    with torch.profiler.profile() as prof:
        fast_out = collect(a)
    assert any("_linear_pointwise" in e.key for e in prof.key_averages())     # the decode passes ran packed
    assert fast_out == collect(b)


def test_engine_keeps_torch_linear_when_packing_fails(nanochat_model, tokenizer, monkeypatch, caplog):
    import core.chat.engine as engine_module

    assert LLMEngine(tiny_model("nanochat", tokenizer), tokenizer, max_rows=2).linear == "torch"   # all too small

    def refuse(model, **_):
        raise RuntimeError("no oneDNN here")

    monkeypatch.setattr(engine_module, "pack_linears", refuse)
    model = tiny_model("nanochat", tokenizer, seed=7)
    with caplog.at_level("WARNING", logger="core.chat.engine"):
        engine = LLMEngine(model, tokenizer, max_rows=2)
    assert engine.linear == "torch-fallback"
    assert [r.getMessage() for r in caplog.records if "F.linear" in r.getMessage()] and "no oneDNN here" in caplog.text
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0), "x")
    assert len(collect(engine)["x"][0]) == 4


def test_prefill_passes_group_chunks_of_similar_length():
    """Every chunk in exactly one pass; a pass pads to its first (longest) chunk and computes at most PAD_LIMIT
    positions per real token unless it holds one chunk; on mixed lengths that is fewer positions than one pass."""
    import random

    from core.chat.engine import PAD_LIMIT, pad_groups

    rng = random.Random(0)
    batch = [(f"r{i}", None, rng.randint(1, 96)) for i in range(40)]
    groups = pad_groups(batch)
    assert sorted(x[0] for g in groups for x in g) == sorted(x[0] for x in batch)
    for g in groups:
        assert g[0][2] == max(t for _, _, t in g)
        assert len(g) == 1 or len(g) * g[0][2] <= PAD_LIMIT * sum(t for _, _, t in g)
    assert sum(len(g) * g[0][2] for g in groups) < len(batch) * max(t for _, _, t in batch)
    same = [("a", None, 5), ("b", None, 5), ("c", None, 5)]
    assert pad_groups(same) == [same]


def test_prompts_of_mixed_lengths_prefilled_together_decode_as_alone(gpt2_model, tokenizer):
    """One step's prompts of 3-60 tokens, prefilled in several passes, give each the tokens it gets alone."""
    ps = prompts(10, seed=9)
    params = SamplingParams(max_tokens=6, temperature=0)
    engine = LLMEngine(gpt2_model, tokenizer, max_rows=10, prefill_chunk=4096)
    for i, p in enumerate(ps):
        engine.add_request(p, params, f"r{i}")
    together = collect(engine)
    assert {rid: out[0] for rid, out in together.items()} == {
        f"r{i}": run_alone(gpt2_model, tokenizer, p, params)[0] for i, p in enumerate(ps)}


@pytest.mark.parametrize("arch", ["nanochat", "modern", "gpt2"])
def test_decode_reads_scattered_rows_in_place_through_the_cpu_kernel(arch, tokenizer):
    """On the CPU, decode attention runs csrc/cache_attention.cpp (the engine says so; no SDPA call and no gather of
    cache rows in a decode step), and with rows scattered over the cache by requests that came and went, each
    stream is the one it is alone. A build that failed would leave SDPA and fail here, not slow the service
    silently."""
    model = tiny_model(arch, tokenizer, seed=3, std=0.3)
    engine = LLMEngine(model, tokenizer, max_rows=6, prefix_caching=False)
    assert engine.attention == "cpu-kernel"
    ps = prompts(6, seed=11)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(ps):                  # every other row frees early: the long ones end up scattered
        engine.add_request(p, params if i % 2 else short, f"r{i}")
    for _ in range(6):
        engine.step()
    assert sorted(s.row for r, s in engine.scheduler.decoding()) == [1, 3, 5]
    from core.chat.kv_cache import CacheBatch

    reads = []
    read = CacheBatch.read
    CacheBatch.read = lambda self, K, V: reads.append(1) or read(self, K, V)     # the rows as a batch (SDPA's input)
    try:
        with torch.profiler.profile() as prof:
            engine.step()
    finally:
        CacheBatch.read = read
    assert not reads and not any("scaled_dot_product" in e.key for e in prof.key_averages())
    batched = collect(engine)
    for i in (1, 3, 5):
        alone = run_alone(model, tokenizer, ps[i], params)[0]
        assert batched[f"r{i}"][0] == alone[len(alone) - len(batched[f"r{i}"][0]):]


def test_every_cpu_kernel_builds_here():
    """The attention kernel, the small-row products and the decode stack all build (extensions.build_all): a
    kernel whose build fails leaves torch's slower ops and a warning, and its own tests skip, so it fails here."""
    from core.chat.extensions import build_all

    assert build_all() == {"cache_attention": True, "small_linear": True, "decode_stack": True}
