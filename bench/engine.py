"""Engine benchmark: single-stream vs 32-stream throughput, time to first token, engine step overhead.

    python -m bench.engine [--json out.json] [--device cpu|cuda]

A small nanochat-architecture model (4 layers, width 256) with random weights; special-token logits are
zeroed so every stream runs its full length. Then the cost of asking for logprobs: 32 streams with
`logprobs` 5 (each token's logprob and the 5 most probable) on every row, beside the same without, and with
penalties and a logit_bias on every row. Prints a table; figures go in bench/README.md with date and machine.
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
from core.chat.tokenizer import train_tokenizer


def bench_model(vocab_size=2048):
    words = "the a cat dog sat on mat red blue green what is capital hello how are you 1 2 3 4 5".split()
    rng = random.Random(0)
    tok = train_tokenizer((" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)), vocab_size)
    cfg = ChatModelConfig(arch="nanochat", vocab_size=tok.vocab_size, n_layer=4, n_head=4, n_kv_head=4, n_embd=256,
                          sequence_len=1024)
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
    from core.chat.kv_cache import KVCache

    device, dtype = model.get_device(), next(model.parameters()).dtype
    cache = KVCache.for_model(model.config, batch, initial_len=position + 1, dtype=dtype, device=device)
    ids = torch.randint(0, 200, (batch, 1), device=device)
    rows, start = list(range(batch)), [position] * batch
    last = torch.zeros(batch, dtype=torch.long, device=device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        logits = model(ids, CacheBatch.build(cache, rows, start, 1), last=last)
        logits.argmax(-1).tolist()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu", help="cpu (fp32) or cuda (bf16)")
    args = p.parse_args()
    torch.manual_seed(0)
    model, tok = bench_model()
    if args.device != "cpu":
        model = model.to(args.device, torch.bfloat16)
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
        "model": "nanochat 4 layers x 256, vocab 2048, " + ("fp32 CPU" if args.device == "cpu" else "bf16 " + args.device),
        "single": one, "concurrent_32": many,
        "speedup_32_vs_1": many["tokens_per_s"] / one["tokens_per_s"],
        "bare_forward_ms_b32": bare,
        "step_over_bare": many["step_ms"] / bare if many["step_ms"] else None,
        "extras_32": extras,
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


if __name__ == "__main__":
    main()
