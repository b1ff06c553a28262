"""Goodput under overload: closed-loop chat clients at 1x, 2x and 4x the load that saturates the service.

    RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_HA_PROXY=1 .venv/bin/serve run serve_config.cpu.yaml &
    python -m bench.overload [--url http://127.0.0.1:8000] [--saturation 32] [--seconds 20] [--max-tokens 64]
                             [--ttft-slo-ms 1000] [--tpot-slo-ms 100] [--json out.json]

Each client streams one short question after another (the `question` workload of bench/http.py, greedy-free
sampling, up to --max-tokens tokens) for --seconds. A 503 is retried: `honour` waits the Retry-After the
service sent, `immediate` resends at once (a retry storm). Reported per run: goodput (tokens/s of completed
requests), requests completed, 503s received, and goodput under an SLO as vLLM's benchmark defines it (the
tokens/s of the requests whose time to first token and mean time per output token both meet the bounds).
`--saturation` is the concurrency the service saturates at (its engine's rows: `chat_max_rows`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time

import httpx

from bench.http import PROMPTS
from bench.sse import Connection, HTTPStatusError


async def client_loop(url, deadline, max_tokens, mode, seed, out):
    conn = Connection(url)
    i = 0
    try:
        while time.perf_counter() < deadline:
            body = {"messages": [{"role": "user", "content": PROMPTS[(seed + i) % len(PROMPTS)]}],
                    "max_tokens": max_tokens, "stream": True, "temperature": 1.0, "seed": seed * 10_000 + i}
            i += 1
            t0, times = time.perf_counter(), []
            try:
                async for line in conn.post_lines("/v1/chat/completions", body):
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        if chunk.get("choices") and (chunk["choices"][0]["delta"].get("content")
                                                     or chunk["choices"][0]["delta"].get("parts")):
                            times.append(time.perf_counter())
            except HTTPStatusError as e:
                if e.status != 503:
                    raise
                out["rejected"] += 1
                if mode == "honour":
                    await asyncio.sleep(float(e.headers.get("retry-after", 1)))
                continue
            if time.perf_counter() <= deadline and times:
                out["done"].append((times[0] - t0, (times[-1] - times[0]) / max(1, len(times) - 1), len(times)))
    finally:
        conn.close()


async def run(url, clients, seconds, max_tokens, mode):
    out = {"rejected": 0, "done": []}
    deadline = time.perf_counter() + seconds
    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop(url, deadline, max_tokens, mode, c, out) for c in range(clients)))
    return out, time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--saturation", type=int, default=32)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ttft-slo-ms", type=float, default=1000)
    p.add_argument("--tpot-slo-ms", type=float, default=100)
    p.add_argument("--modes", nargs="+", default=["honour", "immediate"])
    p.add_argument("--factors", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--json")
    args = p.parse_args()
    httpx.get(f"{args.url}/healthz", timeout=10).raise_for_status()
    results = []
    print(f"{'mode':10}{'clients':>8}{'goodput tok/s':>15}{'SLO goodput':>13}{'done':>7}{'503s':>8}"
          f"{'TTFT p50':>10}")
    for mode in args.modes:
        for f in args.factors:
            clients = f * args.saturation
            out, wall = asyncio.run(run(args.url, clients, args.seconds, args.max_tokens, mode))
            done = out["done"]
            tokens = sum(n for _, _, n in done)
            ok = [n for ttft, tpot, n in done if ttft * 1000 <= args.ttft_slo_ms and tpot * 1000 <= args.tpot_slo_ms]
            ttfts = sorted(t for t, _, _ in done)
            r = {"mode": mode, "clients": clients, "factor": f, "seconds": wall, "completed": len(done),
                 "rejected": out["rejected"], "goodput_tokens_per_s": tokens / wall,
                 "slo_goodput_tokens_per_s": sum(ok) / wall,
                 "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2] if ttfts else None}
            results.append(r)
            print(f"{mode:10}{clients:8d}{r['goodput_tokens_per_s']:15.1f}{r['slo_goodput_tokens_per_s']:13.1f}"
                  f"{len(done):7d}{out['rejected']:8d}{(r['ttft_p50_ms'] or 0):10.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": f"{platform.machine()}, {platform.python_version()}", "slo": {
                "ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms}, "runs": results}, f, indent=2)


if __name__ == "__main__":
    main()
