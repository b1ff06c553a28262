"""The KV cache's memory: what a shared system prompt costs, and how many sequences fit a budget.

    python -m bench.kv_blocks [--before /tmp/before] [--shape 4x256] [--users 64] [--system 1000] [--json out.json]

1. One long system prompt (`--system` tokens) for `--users` concurrent users, each with its own 32-token message
   and 64 new tokens (greedy, ignore_eos), all added at once to the engine alone (one torch thread, the CPU's
   default dtype). Printed: the KV memory the engine holds at its peak (blocks in use x their bytes; for the
   row-per-sequence engine of `--before`, a checkout of the code before the block cache, the bytes its rows
   had grown to), the time to first token p50 and p99 from the add, and the wall time. `--before` runs in a
   child process on that checkout, alternating with this one, twice each.
2. Sequences that fit a fixed KV budget (`--budget` bytes): requests of 256 and of 2,048 tokens (prompt and
   generated together), as many as can run, on an engine whose `chat_max_rows` is no limit; printed, the most
   that ran at once, beside what a row-per-sequence cache of the same bytes holds when every row must be able
   to hold the model's context (`--context`), as on CUDA.

Machine, date and dtype are printed with the figures; they go in bench/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time, statistics, random, torch
sys.path.insert(0, sys.argv[1])
from bench.vllm_peer import random_gpt2
from core.chat import LLMEngine, SamplingParams
torch.set_num_threads(1)
layers, width, users, system = (int(x) for x in sys.argv[2:6])
model, tok = random_gpt2(layers, width, sequence_len=2048)
from core.chat.weights import chat_dtype
dtype = chat_dtype("auto", torch.device("cpu"))[0]
model = model.to(dtype)
engine = LLMEngine(model, tok, max_rows=users)
rng = random.Random(0)
vocab = min(tok.vocab_size, tok.bos_id)
head = [tok.bos_id] + [rng.randrange(vocab) for _ in range(system - 1)]
prompts = [head + [rng.randrange(vocab) for _ in range(32)] for _ in range(users)]
t0 = time.perf_counter()
added = {}
for i, p in enumerate(prompts):
    engine.add_request(p, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True), f"u{i}")
    added[f"u{i}"] = time.perf_counter()
first = {}
while engine.has_work():
    for ev in engine.step():
        if ev.token is not None and ev.request_id not in first:
            first[ev.request_id] = time.perf_counter() - added[ev.request_id]
wall = time.perf_counter() - t0
print("RESULT", json.dumps({"kv_bytes": engine.cache.nbytes(), "ttft": sorted(first.values()), "wall_s": wall,
                            "dtype": str(dtype)}))
"""


def ours_system_prompt(layers: int, width: int, users: int, system: int) -> dict:
    """The block cache: peak blocks in use x bytes per block (sampled every step), TTFT from the add."""
    from bench.vllm_peer import random_gpt2
    from core.chat import LLMEngine, SamplingParams
    from core.chat.kv_cache import KVCache
    from core.chat.weights import chat_dtype

    torch.set_num_threads(1)
    model, tok = random_gpt2(layers, width, sequence_len=2048)
    dtype = chat_dtype("auto", torch.device("cpu"))[0]
    model = model.to(dtype)
    engine = LLMEngine(model, tok, max_rows=users)
    per_block = KVCache.block_bytes(model.config, engine.cache.block_size, dtype)
    rng = random.Random(0)
    vocab = min(tok.vocab_size, tok.bos_id)
    head = [tok.bos_id] + [rng.randrange(vocab) for _ in range(system - 1)]
    prompts = [head + [rng.randrange(vocab) for _ in range(32)] for _ in range(users)]
    t0 = time.perf_counter()
    added, first, peak = {}, {}, 0
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True), f"u{i}")
        added[f"u{i}"] = time.perf_counter()
    while engine.has_work():
        for ev in engine.step():
            if ev.token is not None and ev.request_id not in first:
                first[ev.request_id] = time.perf_counter() - added[ev.request_id]
        peak = max(peak, engine.stats().blocks_used)
    return {"kv_bytes": peak * per_block, "ttft": sorted(first.values()), "wall_s": time.perf_counter() - t0,
            "dtype": str(dtype)}


def before_system_prompt(before: Path, layers: int, width: int, users: int, system: int) -> dict:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(before / ".torch_extensions")}   # its own kernel build
    out = subprocess.run([sys.executable, "-c", CHILD, str(before), str(layers), str(width), str(users), str(system)],
                         capture_output=True, text=True, cwd=before, env=env, timeout=3600)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(line[7:])


def concurrency(layers: int, width: int, budget: int, length: int, context: int) -> dict:
    """Requests of `length` positions (half prompt, half generated) on a cache of `budget` bytes: the most
    running at once, beside the rows of `context` positions the same bytes hold."""
    from bench.vllm_peer import random_gpt2
    from core.chat import LLMEngine, SamplingParams
    from core.chat.kv_cache import KVCache

    torch.set_num_threads(1)
    model, tok = random_gpt2(layers, width, sequence_len=context)
    engine = LLMEngine(model, tok, max_rows=1024, kv_cache_memory=budget, prefix_caching=False,
                       max_waiting=4096)
    rng = random.Random(1)
    vocab = min(tok.vocab_size, tok.bos_id)
    fits_rows = budget // (KVCache.block_bytes(model.config, 1, torch.float32) * context)
    n = 3 * max(1, budget // (KVCache.block_bytes(model.config, 1, torch.float32) * length))
    for i in range(min(n, 1024)):
        prompt = [rng.randrange(vocab) for _ in range(length // 2)]
        engine.add_request(prompt, SamplingParams(max_tokens=length // 2, temperature=0.0, ignore_eos=True), f"r{i}")
    most = 0
    while engine.has_work():
        engine.step()
        most = max(most, engine.stats().running)
    return {"length": length, "budget": budget, "most_running": most, "rows_of_context": fits_rows,
            "preemptions": engine.stats().preemptions}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--before", type=Path, help="a checkout of the row-per-sequence engine (git worktree)")
    p.add_argument("--shape", default="4x256")
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--system", type=int, default=1000)
    p.add_argument("--budget", type=int, default=64 << 20)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--skip-system", action="store_true")
    p.add_argument("--json")
    args = p.parse_args()
    layers, width = (int(x) for x in args.shape.lower().split("x"))
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {platform.processor() or platform.machine()}, torch "
          f"{torch.__version__}, {args.shape}")
    out: dict = {"system_prompt": {"ours": [], "before": []}, "concurrency": []}
    if not args.skip_system:
        for _ in range(2):
            for name in (("ours", "before") if args.before else ("ours",)):
                r = (ours_system_prompt(layers, width, args.users, args.system) if name == "ours"
                     else before_system_prompt(args.before, layers, width, args.users, args.system))
                out["system_prompt"][name].append(r)
                t = r["ttft"]
                print(f"system prompt {args.system} x {args.users} users, {name:6} ({r['dtype']}): KV "
                      f"{r['kv_bytes'] / 2**20:8.1f} MiB, TTFT p50 {1000 * statistics.median(t):7.0f} ms, p99 "
                      f"{1000 * t[int(0.99 * (len(t) - 1))]:7.0f} ms, wall {r['wall_s']:.1f} s", flush=True)
    for length in (256, 2048):
        r = concurrency(layers, width, args.budget, length, args.context)
        out["concurrency"].append(r)
        print(f"{args.budget / 2**20:.0f} MiB of KV, requests of {length} positions: {r['most_running']} ran at once "
              f"(rows of {args.context} positions in the same bytes: {r['rows_of_context']}; "
              f"{r['preemptions']} preemptions)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
