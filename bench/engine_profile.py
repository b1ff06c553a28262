"""Where the chat engine's step time goes, on this host's CPU, before the engine is made faster.

    python -m bench.engine_profile [--shapes 4x256 12x768] [--rows 1 8 32 64] [--prompt 64] [--threads 1]
                                   [--dtype float32|bfloat16] [--weights dtype|int8]
                                   [--archs gpt2 | nanochat nanochat-current]
                                   [--no-packed | --compare-linear] [--json out.json]

For each model shape and architecture (random weights in our layout, the demo vocabulary, fp32: GPT-2 as
bench.vllm_peer builds it, nanochat's release or current architecture as bench.engine does) and each batch of `--rows` new prompts of `--prompt` tokens: one prefill step that takes every
prompt at once, then `--decode-steps` decode steps of every row (greedy, `ignore_eos`). Each step's wall time
is split by timing the engine's own stages in place: the model's forward (`model(...)`: torch's modules and
ops), `CacheBatch.build`, sampling (`LLMEngine._sample`), the output side (`OutputProcessor.accept`) and the
rest (the scheduler, the step's Python). Then torch.profiler over more decode steps: the ops with the most
self CPU time, and the share of the forward's wall time inside torch's ops (the rest of the forward is
Python: module calls, views, the cache's indexing). Each step's GFLOP/s counts the matrix products (q, k, v,
o, the MLP, the head) and attention's two products, against this core's own peak measured here as a large
single-thread fp32 matrix product. `--compare-linear`: instead, the model's forward (a decode pass at 80
keys, a prefill of 64 tokens a row) with torch's F.linear against core/chat/packed.py's packed layers, on
the same weights, alternating.
"""
from __future__ import annotations

import argparse
import collections
import json
import platform
import random
import time
from pathlib import Path

import torch

from bench.vllm_peer import random_gpt2
from core.chat import LLMEngine, SamplingParams
from core.chat.kv_cache import CacheBatch

STAGES = ("forward", "batch build", "sampling", "output side", "rest")


def parse_shape(text: str) -> tuple[int, int]:
    layers, width = text.lower().split("x")
    return int(layers), int(width)


def flops(cfg, tokens: int, keys: int) -> float:
    """FLOPs of one pass over `tokens` new tokens whose attention reads `keys` keys each on average: two per
    multiply-add of q, k, v, o (4 d^2, less with grouped keys and values), the MLP (8 d^2), the head
    (d x vocab) and attention (2 x keys x d, keys cut to a windowed layer's window)."""
    d, kv = cfg.n_embd, cfg.n_kv_head * cfg.head_dim
    per_layer = sum((10 * d * d + 2 * d * kv) + 2 * min(keys, w + 1 if w else keys) * d for w in cfg.layer_windows)
    return 2.0 * tokens * (per_layer + d * cfg.vocab_size)


def model_for(arch: str, n_layer: int, n_embd: int):
    """A random model of `arch` (gpt2 as bench.vllm_peer builds it; nanochat's release or current architecture as
    bench.engine builds it) on the demo vocabulary -> (model, tokenizer)."""
    if arch == "gpt2":
        return random_gpt2(n_layer, n_embd)
    from bench.engine import bench_model
    from core.chat.checkpoint import load_chat_tokenizer

    tok = load_chat_tokenizer(str(Path(__file__).resolve().parent.parent / "models" / "demo-chat"))[0]
    return bench_model(tok=tok, n_layer=n_layer, n_embd=n_embd, arch=arch)


def peak_gflops(n: int = 1536, reps: int = 6) -> float:
    """This core's fp32 matrix-product rate on one thread (the practical peak the engine's products aim at)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e9


class StageClock:
    """Times the engine's stages in place: wraps the engine's model, `_sample`, its output side's `accept` and
    `CacheBatch.build`, adding each call's wall time to `spent[stage]`."""

    def __init__(self, engine: LLMEngine):
        self.spent: collections.Counter = collections.Counter()
        self._undo = []
        clock = self

        def timed(stage, fn):
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    clock.spent[stage] += time.perf_counter() - t0
            return wrapper

        model = engine.model

        class Timed:                            # the engine calls model(...), model.hidden and model.logits
            def __call__(self, *a, **k):
                return timed("forward", model)(*a, **k)

            def __getattr__(self, name):
                attr = getattr(model, name)
                return timed("forward", attr) if name in ("hidden", "logits") else attr

        engine.model = Timed()
        self._undo.append(lambda: setattr(engine, "model", model))
        sample = engine._sample
        engine._sample = timed("sampling", sample)
        self._undo.append(lambda: delattr(engine, "_sample"))
        accept = engine.outputs.accept
        engine.outputs.accept = timed("output side", accept)
        self._undo.append(lambda: delattr(engine.outputs, "accept"))
        build_fn = CacheBatch.__dict__["build"]
        CacheBatch.build = staticmethod(timed("batch build", build_fn.__get__(None, CacheBatch)))
        self._undo.append(lambda: setattr(CacheBatch, "build", build_fn))

    def split(self, wall: float) -> dict[str, float]:
        out = {s: self.spent[s] for s in STAGES[:-1]}
        out["rest"] = wall - sum(out.values())
        return out

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo()


def prompts(rows: int, length: int, vocab: int, bos: int, rng: random.Random) -> list[list[int]]:
    return [[bos] + [rng.randrange(vocab) for _ in range(length - 1)] for _ in range(rows)]


def profile_shape(n_layer: int, n_embd: int, rows_list: list[int], length: int, decode_steps: int,
                  profiled_steps: int, peak: float, seed: int, packed: bool = True, arch: str = "gpt2",
                  dtype: torch.dtype = torch.float32, weights: str = "dtype") -> list[dict]:
    model, tok = model_for(arch, n_layer, n_embd)
    model = model.to(dtype)
    cfg = model.config
    # what a decode step reads of the weights: every linear layer's (the embeddings give one row a token)
    weight_bytes = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)) * (
        1 if weights == "int8" else torch.finfo(dtype).bits // 8)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=decode_steps + profiled_steps + 4, temperature=0, ignore_eos=True)
    out = []
    for rows in rows_list:
        engine = LLMEngine(model, tok, max_rows=rows, prefill_chunk=rows * length, prefix_caching=False,
                           packed_linear=packed, weights=weights)
        for i, p in enumerate(prompts(2, 8, min(tok.vocab_size, tok.bos_id), tok.bos_id, rng)):   # warm-up
            engine.add_request(p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), f"w{i}")
        while engine.has_work():
            engine.step()
        for i, p in enumerate(prompts(rows, length, min(tok.vocab_size, tok.bos_id), tok.bos_id, rng)):
            engine.add_request(p, params, f"r{i}")
        clock = StageClock(engine)
        try:
            t0 = time.perf_counter()
            engine.step()                         # every prompt prefilled, each row's first token sampled
            prefill_wall = time.perf_counter() - t0
            prefill = clock.split(prefill_wall)
            clock.spent.clear()
            t0 = time.perf_counter()
            for _ in range(decode_steps):
                engine.step()
            decode_wall = (time.perf_counter() - t0) / decode_steps
            decode = {k: v / decode_steps for k, v in clock.split(decode_wall * decode_steps).items()}
        finally:
            clock.close()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(profiled_steps):
                engine.step()
        ops = [(e.key, e.self_cpu_time_total / 1e6 / profiled_steps) for e in prof.key_averages()
               if "::" in e.key]          # aten's and oneDNN's (mkldnn::) ops, not the profiler's own records
        ops.sort(key=lambda kv: -kv[1])
        in_ops = sum(t for _, t in ops)
        keys = length + decode_steps // 2
        row = {"arch": arch, "shape": f"{n_layer}x{n_embd}", "rows": rows, "prompt_tokens": length, "linear": engine.linear,
               "prefill_ms": 1000 * prefill_wall, "prefill_split_ms": {k: 1000 * v for k, v in prefill.items()},
               "prefill_gflops": flops(cfg, rows * length, length / 2) / prefill_wall / 1e9,
               "decode_ms": 1000 * decode_wall, "decode_split_ms": {k: 1000 * v for k, v in decode.items()},
               "decode_gflops": flops(cfg, rows, keys) / decode_wall / 1e9,
               "decode_tokens_per_s": rows / decode_wall, "dtype": str(dtype).removeprefix("torch."),
               "weights": weights, "decode_weights_GBps": weight_bytes / decode_wall / 1e9,
               "profiled_ops_ms_per_step": {k: 1000 * v for k, v in ops[:10]},
               "profiled_ops_total_ms_per_step": 1000 * in_ops, "peak_gflops": peak}
        out.append(row)
        print_row(row)
        del engine
    return out


def compare_linear(n_layer: int, n_embd: int, rows_list: list[int], keys: int = 80, rounds: int = 2) -> list[dict]:
    """The model's forward, a decode pass of `rows` rows at `keys` keys and a prefill of rows x 64 tokens, on the
    same weights with F.linear and with packed.py's layers (pack_linears with no size limit: each layer
    packed), alternating `rounds` times; -> the best time of each."""
    from core.chat.kv_cache import KVCache
    from core.chat.packed import pack_linears

    plain, _ = random_gpt2(n_layer, n_embd)
    packed, _ = random_gpt2(n_layer, n_embd)
    pack_linears(packed, min_weight=0)
    reps = max(3, int(200 / (n_layer * n_embd / 256)))

    def decode_ms(model, rows):
        cache = KVCache.for_model(model.config, 1 + rows * 16, 16)
        ids, last = torch.randint(0, 1000, (rows, 1)), torch.zeros(rows, dtype=torch.long)
        cb = CacheBatch.build(cache, cache.tables(rows, 256), [keys] * rows, 1)
        with torch.no_grad():
            model(ids, cb, last=last)
            t0 = time.perf_counter()
            for _ in range(reps):
                model(ids, cb, last=last)
        return 1000 * (time.perf_counter() - t0) / reps

    def prefill_ms(model, rows):
        cache = KVCache.for_model(model.config, 1 + rows * 16, 16)
        ids = torch.randint(0, 1000, (rows, 64))
        with torch.no_grad():
            t0 = time.perf_counter()
            model(ids, CacheBatch.build(cache, cache.tables(rows, 256), [0] * rows, 64),
                  last=torch.zeros(rows, dtype=torch.long))
        return 1000 * (time.perf_counter() - t0)

    out = []
    for rows in rows_list:
        d = {"plain": [], "packed": []}
        p = {"plain": [], "packed": []}
        for _ in range(rounds):
            for name, model in (("plain", plain), ("packed", packed)):
                d[name].append(decode_ms(model, rows))
                p[name].append(prefill_ms(model, rows))
        row = {"arch": arch, "shape": f"{n_layer}x{n_embd}", "rows": rows, "decode_ms": {k: min(v) for k, v in d.items()},
               "prefill_ms": {k: min(v) for k, v in p.items()}}
        row["decode_speedup"] = row["decode_ms"]["plain"] / row["decode_ms"]["packed"]
        row["prefill_speedup"] = row["prefill_ms"]["plain"] / row["prefill_ms"]["packed"]
        print(f"{row['shape']} {rows:3d} rows: decode F.linear {row['decode_ms']['plain']:.2f} ms, packed "
              f"{row['decode_ms']['packed']:.2f} ({row['decode_speedup']:.2f}x); prefill x 64 tokens "
              f"{row['prefill_ms']['plain']:.1f} / {row['prefill_ms']['packed']:.1f} ms "
              f"({row['prefill_speedup']:.2f}x)", flush=True)
        out.append(row)
    return out


def print_row(r: dict) -> None:
    def split(d):
        return ", ".join(f"{k} {v:.2f}" for k, v in d.items())
    print(f"== {r['arch']} {r['shape']} in {r['dtype']} ({r['weights']} weights), {r['rows']} rows x "
          f"{r['prompt_tokens']} prompt tokens, linear layers: {r['linear']}")
    print(f"  prefill {r['prefill_ms']:.1f} ms ({split(r['prefill_split_ms'])}), "
          f"{r['prefill_gflops']:.1f} GFLOP/s of {r['peak_gflops']:.0f}")
    print(f"  decode {r['decode_ms']:.2f} ms a step, {r['decode_tokens_per_s']:.0f} tokens/s "
          f"({split(r['decode_split_ms'])}), {r['decode_gflops']:.1f} GFLOP/s, weights read at "
          f"{r['decode_weights_GBps']:.1f} GB/s")
    print(f"  torch ops under the profiler {r['profiled_ops_total_ms_per_step']:.2f} ms a decode step: "
          + ", ".join(f"{k.split('::')[-1]} {v:.2f}" for k, v in list(r["profiled_ops_ms_per_step"].items())[:8]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["4x256", "12x768"], help="LAYERSxWIDTH")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--archs", nargs="+", default=["gpt2"], choices=("gpt2", "nanochat", "nanochat-current"),
                   help="the architectures to profile, each shape in turn (same prompts per shape)")
    p.add_argument("--prompt", type=int, default=64, help="tokens per prompt")
    p.add_argument("--decode-steps", type=int, default=24)
    p.add_argument("--profiled-steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--weights", default="dtype", choices=("dtype", "int8"), help="int8: as chat_weights: int8")
    p.add_argument("--no-packed", action="store_true", help="the linear layers on F.linear (EngineConfig.packed_linear off)")
    p.add_argument("--compare-linear", action="store_true",
                   help="instead: the forward with F.linear against every layer packed, alternating, per row count")
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    peak = peak_gflops()
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s); "
          f"fp32 matrix product peak here {peak:.1f} GFLOP/s")
    if args.compare_linear:
        rows = [r for shape in args.shapes for r in compare_linear(*parse_shape(shape), args.rows)]
        if args.json:
            Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "threads": args.threads,
                                                   "compare_linear": rows}, indent=2))
        return
    rows = []
    for i, shape in enumerate(args.shapes):
        for arch in args.archs:
            rows += profile_shape(*parse_shape(shape), args.rows, args.prompt, args.decode_steps,
                                  args.profiled_steps, peak, seed=100 + i, packed=not args.no_packed, arch=arch,
                                  dtype=getattr(torch, args.dtype), weights=args.weights)
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "threads": args.threads,
                                               "peak_gflops": peak, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
