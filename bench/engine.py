"""Engine benchmark: single-stream vs 32-stream throughput, time to first token, engine step overhead.

    python -m bench.engine [--json out.json] [--device cpu|cuda] [--structured-only] [--streams 32 128 ...]
                           [--shape 12x768] [--archs nanochat nanochat-current] [--sequence-len 1024]

A small nanochat-architecture model (4 layers, width 256) with random weights; special-token logits are
zeroed so every stream runs its full length. Then the cost of asking for logprobs: 32 streams with
`logprobs` 5 (each token's logprob and the 5 most probable) on every row, beside the same without, and with
penalties and a logit_bias on every row. Then structured outputs: 32 streams, every row constrained by a JSON
schema (an array of at least 64 small objects, so no row ends before max_tokens), beside the same streams free,
on the demo chat model's vocabulary (models/demo-chat, 1,954 tokens) and on a GPT-2-sized one (50,257 tokens,
random): the same model with a wider or narrower embedding and head. `--streams` runs only the plain streams at
the counts given (each twice, alternating, after a warm-up) with the bare forward pass at the largest. Prints a
table; figures go in bench/README.md with date and machine.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch

from core.chat import ChatModelConfig, LLMEngine, SamplingParams, build_model
from core.chat.kv_cache import CacheBatch
from core.chat.model import init_weights
from core.chat.checkpoint import load_chat_tokenizer
from core.chat.grammars import json_grammar
from core.chat.tokenizer import ChatTokenizer, train_tokenizer

# every row's output, kept going to max_tokens: at least 64 objects of three kinds of value
LONG_JSON = {"type": "object", "properties": {"items": {"type": "array", "minItems": 64, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                     "name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
    "required": ["id", "name", "ok"], "additionalProperties": False}}}, "required": ["items"],
    "additionalProperties": False}


def random_vocab(size: int, seed: int = 0) -> ChatTokenizer:
    """A byte-level vocabulary of `size` tokens (GPT-2's is 50,257), random: the 256 bytes, then word pieces with
    and without a leading space, numbers, runs of punctuation and of whitespace; the chat tokens after them."""
    rng = random.Random(seed)
    cons, vows, punct = "bcdfghjklmnprstvwz", "aeiou", list('":,{}[].-_\'()!?;')
    tokens = [bytes([b]) for b in range(256)]
    seen = set(tokens)
    while len(tokens) < size - 9:
        r = rng.random()
        if r < 0.6:
            t = "".join(rng.choice(cons) + rng.choice(vows) for _ in range(rng.randint(1, 4)))
            t = (" " if rng.random() < 0.6 else "") + (t.capitalize() if rng.random() < 0.2 else t)
        elif r < 0.75:
            t = (" " if rng.random() < 0.3 else "") + str(rng.randrange(10 ** rng.randint(1, 4)))
        elif r < 0.92:
            t = "".join(rng.choice(punct) for _ in range(rng.randint(2, 4)))
        else:
            t = rng.choice(["\n", " ", "\t"]) * rng.randint(2, 8)
        if t.encode() not in seen:
            seen.add(t.encode())
            tokens.append(t.encode())
    return ChatTokenizer.from_ranks({t: i for i, t in enumerate(tokens)})


ARCHS = ("nanochat", "nanochat-current")     # nanochat's release architecture, and its current code's


def bench_model(vocab_size=2048, tok=None, n_layer=4, n_embd=256, arch="nanochat", sequence_len=1024):
    """A random nanochat model (heads of 64); arch "nanochat-current": with every feature of nanochat's newest
    version as the converter sets them (nanochat_versions.py: windows SSSL of sequence_len / 4, value
    embeddings, lambdas, q/k scale, smear, backout)."""
    from core.chat.nanochat_versions import VERSIONS, config_fields

    words = "the a cat dog sat on mat red blue green what is capital hello how are you 1 2 3 4 5".split()
    rng = random.Random(0)
    if tok is None:
        tok = train_tokenizer((" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)), vocab_size)
    sizes = dict(vocab_size=tok.vocab_size, n_layer=n_layer, n_head=n_embd // 64, n_kv_head=n_embd // 64,
                 n_embd=n_embd, sequence_len=sequence_len)
    if arch == "nanochat-current":
        cfg = ChatModelConfig(**config_fields(VERSIONS[-1], dict(sizes, window_pattern="SSSL")))
    else:
        cfg = ChatModelConfig(arch="nanochat", **sizes)
    model = init_weights(build_model(cfg), seed=0, std=0.3).eval()
    with torch.no_grad():
        model.lm_head.weight[min(tok.special_tokens.values()):] = 0.0
    return model, tok


def run_streams(model, tok, n_streams, prompt_len, max_tokens, **extra):
    engine = LLMEngine(model, tok, max_rows=max(n_streams, 1), prefill_chunk=2048)
    rng = random.Random(1)
    t0 = time.perf_counter()
    for i in range(n_streams):
        engine.add_request([rng.randrange(200) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, **extra), f"s{i}")
    first, tokens, step_times = {}, 0, []
    while engine.has_work():
        s0 = time.perf_counter()
        events = engine.step()
        dt = time.perf_counter() - s0
        full = engine.stats().running == n_streams
        for ev in events:
            if ev.token is not None:
                tokens += 1
                first.setdefault(ev.request_id, time.perf_counter() - t0)
        if full and len(events) == n_streams and all(ev.token is not None for ev in events):
            step_times.append(dt)
    wall = time.perf_counter() - t0
    return {"streams": n_streams, "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_ms": 1000 * statistics.median(first.values()),
            "step_ms": 1000 * statistics.median(step_times) if step_times else None}


@torch.inference_mode()
def bare_forward_ms(model, batch, position, repeats=50):
    from core.chat.kv_cache import KVCache, LayerGroups

    device, dtype = model.get_device(), next(model.parameters()).dtype
    groups = len(LayerGroups.of(model.config.layer_windows))
    cache = KVCache.for_model(model.config, 1 + groups * batch * -(-(position + 1) // 16), 16, dtype=dtype,
                              device=device)
    ids = torch.randint(0, 200, (batch, 1), device=device)
    rows, start = cache.tables(batch, position + 1), [position] * batch
    last = torch.zeros(batch, dtype=torch.long, device=device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        logits = model(ids, CacheBatch.build(cache, rows, start, 1, [0] * batch), last=last)
        logits.argmax(-1).tolist()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def structured(model, tok, prompt_len, max_tokens, runs=3) -> dict:
    """32 streams free and 32 constrained by LONG_JSON, alternating (this machine is noisy): the best of `runs`
    each, and the constrained decode step over the free one."""
    grammar = json_grammar(LONG_JSON, "bench")
    run_streams(model, tok, 4, 16, 8, grammar=grammar)      # warm-up: the vocabulary index, the first masks
    free, constrained = [], []
    for _ in range(runs):
        free.append(run_streams(model, tok, 32, prompt_len, max_tokens))
        constrained.append(run_streams(model, tok, 32, prompt_len, max_tokens, grammar=grammar))
    best = lambda rs: min(rs, key=lambda r: r["step_ms"])   # noqa: E731
    f, c = best(free), best(constrained)
    steps = lambda rs: [r["step_ms"] for r in rs]            # noqa: E731
    return {"vocab": tok.vocab_size, "free": f, "json_schema": c, "step_ratio": c["step_ms"] / f["step_ms"],
            "median_ratio": statistics.median(steps(constrained)) / statistics.median(steps(free)),
            "pairwise_median_ratio": statistics.median(b / a for a, b in zip(steps(free), steps(constrained)))}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--structured-only", action="store_true", help="only the structured-output comparison")
    p.add_argument("--structured-runs", type=int, default=3, help="alternating free/constrained runs per vocabulary")
    p.add_argument("--json")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu", help="cpu (fp32) or cuda (bf16)")
    p.add_argument("--streams", type=int, nargs="+", help="only plain streams at these counts")
    p.add_argument("--shape", default="4x256", help="with --streams: the model's layers x width (heads of 64)")
    p.add_argument("--archs", nargs="+", default=["nanochat"], choices=ARCHS,
                   help="with --streams: nanochat's release and/or current architecture, alternating in one run")
    p.add_argument("--sequence-len", type=int, default=1024, help="with --streams: the models' context (and so "
                   "nanochat-current's short window, a quarter of it rounded up to 128)")
    args = p.parse_args()
    torch.manual_seed(0)
    if args.streams:
        n_layer, n_embd = map(int, args.shape.split("x"))
        models = {}
        for arch in args.archs:
            model, tok = bench_model(n_layer=n_layer, n_embd=n_embd, arch=arch, sequence_len=args.sequence_len)
            models[arch] = (model.to(args.device, torch.bfloat16) if args.device != "cpu" else model, tok)
        return streams_only(models, args)
    model, tok = bench_model()
    demo, demo_tok = bench_model(tok=load_chat_tokenizer("models/demo-chat")[0])
    big, big_tok = bench_model(tok=random_vocab(50257))
    if args.device != "cpu":
        model, demo, big = (m.to(args.device, torch.bfloat16) for m in (model, demo, big))
    shaped = [structured(m, t, args.prompt_len, args.max_tokens, args.structured_runs)
              for m, t in ((demo, demo_tok), (big, big_tok))]
    for r in shaped:
        print(f"vocab {r['vocab']:6}: 32 streams free {r['free']['tokens_per_s']:8.1f} tokens/s, decode step "
              f"{r['free']['step_ms']:.2f} ms; all JSON-schema constrained {r['json_schema']['tokens_per_s']:8.1f} "
              f"tokens/s, step {r['json_schema']['step_ms']:.2f} ms (best {r['step_ratio']:.2f}x, medians "
              f"{r['median_ratio']:.2f}x, pairwise median {r['pairwise_median_ratio']:.2f}x)")
    if args.structured_only:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"structured_32": shaped}, f, indent=2)
        return
    run_streams(model, tok, 2, 16, 8)   # warm-up
    one = run_streams(model, tok, 1, args.prompt_len, args.max_tokens)
    many = run_streams(model, tok, 32, args.prompt_len, args.max_tokens)
    bare = bare_forward_ms(model, 32, args.prompt_len + args.max_tokens // 2)
    # asked-for extras, alternating with plain runs (this machine is noisy): best of 3 each
    variants = {"none": {}, "logprobs 5": {"logprobs": 5},
                "penalties + bias": {"frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {7: 1.0}}}
    extras = {name: max((run_streams(model, tok, 32, args.prompt_len, args.max_tokens, **kw) for _ in range(3)),
                        key=lambda r: r["tokens_per_s"]) for name, kw in variants.items()}
    result = {
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}"
                   + (f", {torch.cuda.get_device_name()}" if args.device != "cpu" else ""),
        "model": f"nanochat 4 layers x 256, vocab {tok.vocab_size}, " + ("fp32 CPU" if args.device == "cpu" else "bf16 " + args.device),
        "single": one, "concurrent_32": many,
        "speedup_32_vs_1": many["tokens_per_s"] / one["tokens_per_s"],
        "bare_forward_ms_b32": bare,
        "step_over_bare": many["step_ms"] / bare if many["step_ms"] else None,
        "extras_32": extras,
        "structured_32": shaped,
    }
    print(f"{'':24}{'1 stream':>12}{'32 streams':>12}")
    print(f"{'tokens/s':24}{one['tokens_per_s']:12.1f}{many['tokens_per_s']:12.1f}")
    print(f"{'TTFT p50 (ms)':24}{one['ttft_p50_ms']:12.1f}{many['ttft_p50_ms']:12.1f}")
    print(f"{'decode step (ms)':24}{one['step_ms'] or 0:12.2f}{many['step_ms'] or 0:12.2f}")
    print(f"aggregate speedup 32 vs 1: {result['speedup_32_vs_1']:.1f}x")
    print(f"engine step / bare forward at batch 32: {many['step_ms']:.2f} / {bare:.2f} ms = "
          f"{result['step_over_bare']:.2f}x")
    for name, r in extras.items():
        print(f"32 streams, {name:18} {r['tokens_per_s']:9.1f} tokens/s, decode step {r['step_ms']:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def streams_only(models: dict, args) -> None:
    """Plain streams at each count of --streams for each model of --archs, two runs each in alternating order
    (counts and models), the better one kept."""
    for model, tok in models.values():
        run_streams(model, tok, 2, 16, 8)   # warm-up (and, on a GPU, the CUDA graphs' capture for these sizes)
        for n in args.streams:
            run_streams(model, tok, n, 16, 8)
    cases = [(arch, n) for n in args.streams for arch in models]
    runs = {case: [] for case in cases}
    for order in (cases, cases[::-1]):
        for arch, n in order:
            model, tok = models[arch]
            runs[arch, n].append(run_streams(model, tok, n, args.prompt_len, args.max_tokens))
    best = {case: max(rs, key=lambda r: r["tokens_per_s"]) for case, rs in runs.items()}
    bare = {arch: bare_forward_ms(model, max(args.streams), args.prompt_len + args.max_tokens // 2)
            for arch, (model, _) in models.items()}
    device = torch.cuda.get_device_name() if args.device != "cpu" else platform.machine()
    print(f"{device}, torch {torch.__version__}, {args.shape}, {args.prompt_len}-token prompts, {args.max_tokens} new "
          f"tokens, context {args.sequence_len}")
    print(f"{'arch':>18}{'streams':>8}{'tokens/s':>12}{'(other run)':>12}{'TTFT p50 ms':>13}{'step ms':>9}")
    for (arch, n), r in best.items():
        other = min(x["tokens_per_s"] for x in runs[arch, n])
        print(f"{arch:>18}{n:8}{r['tokens_per_s']:12.0f}{other:12.0f}{r['ttft_p50_ms']:13.1f}{r['step_ms'] or 0:9.2f}")
    for arch, ms in bare.items():
        print(f"{arch}: bare forward at batch {max(args.streams)}: {ms:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "runs": {f"{a} {n}": r for (a, n), r in runs.items()},
                       "bare_forward_ms": bare}, f, indent=2)

if __name__ == "__main__":
    main()
