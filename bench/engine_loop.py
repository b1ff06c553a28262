"""The HTTP benchmark's chat workloads against the engine alone: no Serve, no HTTP.

    python -m bench.engine_loop [--checkpoint models/demo-chat] [--per-client 4] [--max-tokens 64]
                                [--prefill-chunk 512] [--workloads question history long multiturn]
                                [--front thread|process] [--torch-threads N] [--device cpu|cuda]
                                [--prefix-caching on off]

`--front thread` (the default) steps the engine on a thread of this process (ThreadEngine); `--front process`
in a child process (ProcessEngine, what the chat replica uses), so the clients' event loop and the model
do not share a GIL.

Same closed loop and workloads as bench/http.py (each of N clients sends its next request when the last one
ends) on the demo chat checkpoint, so the two tables side by side show what the serving path adds to time to
first token and throughput. `multiturn`: each client continues its own conversation for `MULTITURN_TURNS`
turns, resending the whole history (its earlier questions and the model's own replies, calculator parts
included) every turn, as chat UIs do. Every workload runs once per `--prefix-caching` setting (an engine of
its own each), and the table counts the prompt tokens the engine computed (looked up less found in the prefix
cache).
"""
from __future__ import annotations

import argparse
import asyncio
import time

from bench.http import WORKLOADS, conversations, pct
from tools import demo_data as D

MULTITURN_TURNS = 8
from core.chat import ChatPrompter, SamplingParams, load_chat_defaults, load_chat_tokenizer
from core.chat.engine_process import start_engine
from core.chat.protocol import EngineConfig, EngineStart


async def closed_loop(engine, prompter, clients, per_client, max_tokens, turns, ignore_eos):
    histories = conversations(clients * per_client, turns)
    ttft, tokens = [], 0

    async def client(c):
        nonlocal tokens
        for j in range(per_client):
            k = c * per_client + j
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=k, ignore_eos=ignore_eos)
            t0, first = time.perf_counter(), None
            async for batch in engine.generate(prompter.render(histories[k], max_tokens).ids, params):
                shown = sum(1 for ev in batch if ev.text)      # like bench.http: events that carry output
                if shown and first is None:
                    first = time.perf_counter() - t0
                tokens += shown
            ttft.append(first if first is not None else time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    wall = time.perf_counter() - t0
    return {"tokens_per_s": tokens / wall, "ttft_p50_ms": 1000 * pct(ttft, 0.5), "ttft_p99_ms": 1000 * pct(ttft, 0.99)}


async def multiturn(engine, prompter, clients, turns, max_tokens, seed=11):
    """Each client: `turns` questions of the demo domain in one conversation, the model's replies (as parts)
    sent back with every new question."""
    import random

    ttft, tokens = [], 0

    async def client(c):
        nonlocal tokens
        rng = random.Random(seed * 1000 + c)
        history: list[dict] = []
        for turn in range(turns):
            q, _, _ = (D.fact_turn if rng.random() < 0.5 else D.math_turn)(rng, follow=turn > 0)
            history.append({"role": "user", "content": q})
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=c * turns + turn)
            parts: list[dict] = []
            t0, first = time.perf_counter(), None
            async for batch in engine.generate(prompter.render(history, max_tokens).ids, params):
                for ev in batch:
                    if ev.text and first is None:
                        first = time.perf_counter() - t0
                    tokens += bool(ev.text)
                    if ev.text or ev.closes:
                        if parts and parts[-1]["type"] == ev.segment and not parts[-1].get("closed"):
                            parts[-1]["text"] += ev.text
                        else:
                            parts.append({"type": ev.segment, "text": ev.text})
                        if ev.closes:
                            parts[-1]["closed"] = True
            ttft.append(first if first is not None else time.perf_counter() - t0)
            history.append({"role": "assistant", "content": [{"type": p["type"], "text": p["text"]} for p in parts]})

    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    wall = time.perf_counter() - t0
    return {"tokens_per_s": tokens / wall, "ttft_p50_ms": 1000 * pct(ttft, 0.5), "ttft_p99_ms": 1000 * pct(ttft, 0.99)}


def computed_prompt_tokens(engine) -> int:
    time.sleep(0.6)                 # the engine process reports its idle stats after its last step
    s = engine.stats()
    return s.prefix_query_tokens - s.prefix_hit_tokens


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", default="models/demo-chat")
    p.add_argument("--per-client", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prefill-chunk", type=int, default=512, help="the engine's prompt tokens per step")
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS) + ["multiturn"],
                   default=list(WORKLOADS) + ["multiturn"])
    p.add_argument("--prefix-caching", nargs="+", choices=("on", "off"), default=["on", "off"])
    p.add_argument("--front", choices=("thread", "process"), default="thread")
    p.add_argument("--torch-threads", type=int, help="torch threads of the model (default: torch's)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (bf16)")
    args = p.parse_args()
    print(f"device {args.device}, front {args.front}")
    tok, cfg = load_chat_tokenizer(args.checkpoint)
    prompter = ChatPrompter(tok, cfg.sequence_len, load_chat_defaults(args.checkpoint).fewshot)
    print(f"{'cache':6}{'workload':10}{'streams':>8}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'prompt tokens computed':>24}")
    for cache in args.prefix_caching:
        config = EngineConfig(prefill_chunk=args.prefill_chunk, torch_threads=args.torch_threads,
                              prefix_caching=cache == "on", process=args.front == "process")
        engine = start_engine(EngineStart(args.checkpoint, args.device, config, tuple(prompter.prefix_ids)))
        try:
            asyncio.run(closed_loop(engine, prompter, 2, 1, 8, 0, False))     # warm-up
            for name in args.workloads:
                for n in (1, 32):
                    before = computed_prompt_tokens(engine)
                    if name == "multiturn":
                        r = asyncio.run(multiturn(engine, prompter, n, MULTITURN_TURNS, args.max_tokens))
                    else:
                        turns, ignore_eos = WORKLOADS[name]
                        r = asyncio.run(closed_loop(engine, prompter, n, args.per_client, args.max_tokens, turns,
                                                    ignore_eos))
                    computed = computed_prompt_tokens(engine) - before
                    print(f"{cache:6}{name:10}{n:8d}{r['tokens_per_s']:9.1f}{r['ttft_p50_ms']:10.1f}"
                          f"{r['ttft_p99_ms']:10.1f}{computed:24d}", flush=True)
        finally:
            engine.shutdown()


if __name__ == "__main__":
    main()
