"""Multi-turn conversations against this service and vLLM: how much of each turn's history the prefix cache serves.

    python -m bench.multiturn --vllm-python /tmp/vllm-venv/bin/python [--runs 2] [--conversations 96]
                              [--turns 5] [--concurrency 32] [--set chat_kv_cache_memory=1073741824]

The load is what chat users and agent loops send: each conversation resends its whole history every turn. Every
conversation starts with one 64-token system prompt and its own 32-token user message; each later turn is the
previous prompt, a 64-token stand-in for the reply and a new 32-token user message (the stand-in, not the
generated reply, so both servers get the same prompts). `--concurrency` requests run at a time, from a queue in
which a conversation's next turn goes behind every turn already queued (turn 1 of all, then their turns 2 as they
finish, ...), so a conversation comes back only after the others have had theirs: the history must survive
that long in the cache. Requests are streamed token-id `/v1/completions`, greedy, `ignore_eos`, 64 new tokens.

Both servers run the same random GPT-2 (bench.vllm_peer's, `--shape`) at their defaults (bf16 where the CPU
computes it natively), started in turn, alternating, `--runs` times; vLLM with its 1 GiB KV cache
(bench.vllm_peer.VLLM_ENV). Printed per run: output tokens/s, TTFT p50, and the share of prompt tokens served
from the cache, read from each server's own counters before and after the load (ours: /debug/stats'
prefix_cache; vLLM: its /metrics' prefix_cache_queries and prefix_cache_hits), beside the most any cache could
serve (the system prompt of turn 1 and each later turn's previous prompt). `--engine-alone` runs the same
conversations against this project's engine in this process instead: the serving path's share of the time.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import tempfile
import time
from collections import deque
from pathlib import Path

import httpx

from bench.sse import Connection
from bench.vllm_peer import app_overrides, build_checkpoints, start_ours, start_vllm, stream_once

SYSTEM, USER, REPLY, NEW = 64, 32, 64, 64


def conversations(n: int, turns: int, vocab: int, bos: int, seed: int = 0) -> list[list[list[int]]]:
    """n conversations' prompts, turn by turn."""
    rng = random.Random(seed)

    def words(k):
        return [rng.randrange(vocab) for _ in range(k)]

    system = [bos] + words(SYSTEM - 1)
    out = []
    for _ in range(n):
        prompt = system + words(USER)
        turns_ = [prompt]
        for _ in range(turns - 1):
            prompt = prompt + words(REPLY) + words(USER)
            turns_.append(prompt)
        out.append(turns_)
    return out


def cacheable(convs: list[list[list[int]]]) -> float:
    """The share of prompt tokens a perfect cache could serve: the shared system prompt, then the previous turn."""
    total = sum(len(p) for c in convs for p in c)
    best = sum(SYSTEM if t == 0 else len(c[t - 1]) for c in convs for t in range(len(c))) - SYSTEM
    return best / total


async def run_load(url: str, model: str | None, convs: list[list[list[int]]], concurrency: int) -> dict:
    queue = deque((c, 0) for c in range(len(convs)))
    ttfts, tokens, failed = [], 0, 0
    wake = asyncio.Event()
    active = 0

    async def worker() -> None:
        nonlocal tokens, failed, active
        conn = Connection(url)
        try:
            while True:
                while not queue:
                    if active == 0:
                        return
                    wake.clear()
                    await wake.wait()
                c, t = queue.popleft()
                active += 1
                t0 = time.perf_counter()
                try:
                    ttft, n = await stream_once(conn, model, convs[c][t], NEW)
                except Exception:   # noqa: BLE001 - counted, reported
                    failed += 1
                    ttft, n = time.perf_counter() - t0, 0
                    conn.close()
                    conn = Connection(url)
                ttfts.append(ttft)
                tokens += n
                active -= 1
                if t + 1 < len(convs[c]):
                    queue.append((c, t + 1))
                wake.set()
        finally:
            conn.close()
            wake.set()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"tokens_per_s": tokens / wall, "ttft_p50_ms": 1000 * statistics.median(ttfts), "failed": failed,
            "requests": len(ttfts), "wall_s": wall}


def engine_alone(checkpoint: Path, convs: list[list[list[int]]], concurrency: int, memory: int | None) -> dict:
    """The same conversations against this project's engine in this process (one torch thread, its default
    dtype), the same queue discipline: what the engine makes of the load without the serving path."""
    import torch

    from core.chat import LLMEngine, SamplingParams
    from core.chat.weights import chat_dtype, load_chat_model

    torch.set_num_threads(1)
    model, tok, _ = load_chat_model(str(checkpoint), "cpu", chat_dtype("auto", torch.device("cpu"))[0])
    engine = LLMEngine(model, tok, max_rows=32, kv_cache_memory=memory)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    queue = deque((c, 0) for c in range(len(convs)))
    started, ttfts, tokens, turn_of = {}, [], 0, {}
    t0 = time.perf_counter()
    while queue or engine.has_work():
        while queue and len(started) < concurrency:
            c, t = queue.popleft()
            rid = engine.add_request(convs[c][t], params)
            started[rid], turn_of[rid] = time.perf_counter(), (c, t)
        for ev in engine.step():
            if ev.token is not None:
                tokens += 1
                if ev.completion_tokens == 1:
                    ttfts.append(time.perf_counter() - started[ev.request_id])
            if ev.finish_reason is not None:
                started.pop(ev.request_id)
                c, t = turn_of.pop(ev.request_id)
                if t + 1 < len(convs[c]):
                    queue.append((c, t + 1))
    wall = time.perf_counter() - t0
    s = engine.stats()
    return {"tokens_per_s": tokens / wall, "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "cached_share": s.prefix_hit_tokens / max(1, s.prefix_query_tokens), "wall_s": wall}


def ours_cache(url: str) -> tuple[int, int]:
    s = httpx.get(url + "/debug/stats", timeout=30).json()["chat"]["prefix_cache"]
    return s["query_tokens"], s["hit_tokens"]


def vllm_cache(url: str) -> tuple[int, int]:
    text = httpx.get(url + "/metrics", timeout=30).text

    def total(name: str) -> int:
        return int(sum(float(v) for v in re.findall(rf"^vllm:{name}_total{{[^}}]*}} ([0-9.e+]+)$", text, re.M)))

    return total("prefix_cache_queries"), total("prefix_cache_hits")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vllm-python", required=True, help="the python of vLLM's own venv")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--conversations", type=int, default=96)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--shape", default="4x256")
    p.add_argument("--only", choices=("ours", "vllm"), help="one server only")
    p.add_argument("--engine-alone", action="store_true",
                   help="instead: the same conversations against this project's engine in this process")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an application argument of ours over serve_config.cpu.yaml's")
    p.add_argument("--json")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="multiturn-"))
    layers, width = (int(x) for x in args.shape.lower().split("x"))
    ours_dir, hf_dir, vocab, bos = build_checkpoints(work, layers, width)
    convs = conversations(args.conversations, args.turns, min(vocab, bos), bos)
    warm = conversations(4, 1, min(vocab, bos), bos, seed=1)
    best = cacheable(convs)
    results: dict[str, list] = {"ours": [], "vllm": []}
    if args.engine_alone:
        memory = app_overrides(args.set).get("chat_kv_cache_memory")
        for run in range(args.runs):
            r = engine_alone(ours_dir, convs, args.concurrency, memory)
            print(f"engine alone run {run + 1}: {r['tokens_per_s']:8.1f} tokens/s, TTFT p50 "
                  f"{r['ttft_p50_ms']:6.0f} ms, "
                  f"cached {100 * r['cached_share']:5.1f}% of prompt tokens (at most {100 * best:.1f}%)", flush=True)
        return
    names = [args.only] if args.only else ["ours", "vllm"]
    for run in range(args.runs):
        for name in (names if run % 2 == 0 else names[::-1]):
            server = (start_ours(ours_dir, work, app_overrides(args.set)) if name == "ours"
                      else start_vllm(args.vllm_python, hf_dir, work))
            model = None if name == "ours" else "peer"
            counters = ours_cache if name == "ours" else vllm_cache
            try:
                server.wait_ready()
                asyncio.run(run_load(server.url, model, warm, 4))
                q0, h0 = counters(server.url)
                r = asyncio.run(run_load(server.url, model, convs, args.concurrency))
                q1, h1 = counters(server.url)
                r["cached_share"] = (h1 - h0) / max(1, q1 - q0)
                results[name].append(r)
                print(f"{name:5} run {run + 1}: {r['tokens_per_s']:8.1f} tokens/s, TTFT p50 {r['ttft_p50_ms']:6.0f} "
                      f"ms, cached {100 * r['cached_share']:5.1f}% of prompt tokens (at most {100 * best:.1f}%), "
                      f"{r['failed']} failed of {r['requests']}", flush=True)
            finally:
                server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "shape": args.shape,
                                               "cacheable": best, "results": results}, indent=2))


if __name__ == "__main__":
    main()
