"""HTTP benchmark of the running service, against a seed-001-style baseline on the same checkpoint.

    .venv/bin/serve run serve_config.cpu.yaml &          # the service under test
    python -m bench.http [--url http://127.0.0.1:8000] [--checkpoint models/demo-chat] [--json out.json]
                         [--svg bench/http.svg]

Chat with 1, 8 and 32 concurrent streams (time to first token and inter-token latency p50/p99, aggregate
tokens/s), decisions with 32 concurrent clients (questions/s, p50/p99), and the baseline (one generation
at a time under a lock, no KV cache; bench/baseline.py) started here on another port. Streams count
chunks that carry output (text, or a calculator call or result) on both sides, so the comparison is like
for like.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import socket
import threading
import time

import httpx

PROMPTS = ["hello", "What is the capital of France?", "What is 1234 times 56?", "Capital of Peru?"]


def pct(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one_stream(client, url, i, max_tokens):
    body = {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "max_tokens": max_tokens,
            "stream": True, "temperature": 1.0, "seed": i}
    t0 = time.perf_counter()
    times = []
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
                if delta.get("content") or delta.get("parts"):     # text, or a calculator call or result
                    times.append(time.perf_counter())
    return t0, times


async def chat_load(url, streams, max_tokens):
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, url, i, max_tokens) for i in range(streams)))
        wall = time.perf_counter() - t0
    ttft = [times[0] - start for start, times in results if times]
    itl = [b - a for _, times in results for a, b in zip(times, times[1:])]
    tokens = sum(len(times) for _, times in results)
    return {"streams": streams, "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_ms": 1000 * pct(ttft, 0.5), "ttft_p99_ms": 1000 * pct(ttft, 0.99),
            "itl_p50_ms": 1000 * pct(itl, 0.5) if itl else None, "itl_p99_ms": 1000 * pct(itl, 0.99) if itl else None}


async def decision_load(url, clients, per_client):
    body = {"state": "the cat is red and the dog is blue",
            "questions": {"color": {"question": "which color is the cat", "criteria": {"r": "red", "b": "blue"}},
                          "cat": {"type": "noul", "question": "is there a cat"},
                          "size": {"type": "score", "question": "how big", "criteria": ["small", "medium", "big"]}}}
    latencies = []

    async def worker(client):
        for _ in range(per_client):
            t0 = time.perf_counter()
            r = await client.post(f"{url}/v1/systemone", json=body)
            r.raise_for_status()
            latencies.append(time.perf_counter() - t0)

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"clients": clients, "requests": len(latencies), "questions_per_s": 3 * len(latencies) / wall,
            "p50_ms": 1000 * pct(latencies, 0.5), "p99_ms": 1000 * pct(latencies, 0.99)}


def start_baseline(checkpoint):
    import uvicorn

    from bench.baseline import make_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(checkpoint), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


def svg_bars(path, title, groups):
    """A small bar chart without plotting dependencies: groups = [(label, [(series, value)])]."""
    width, height, left, top = 640, 300, 60, 40
    vmax = max(v for _, series in groups for _, v in series) or 1
    n = len(groups)
    slot = (width - left - 20) / n
    colors = ["#4c78a8", "#f58518", "#54a24b"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>']
    base = height - 40
    for g, (label, series) in enumerate(groups):
        bw = slot / (len(series) + 1)
        for s, (name, v) in enumerate(series):
            h = (base - top) * v / vmax
            x = left + g * slot + s * bw + bw / 2
            out.append(f'<rect x="{x:.1f}" y="{base - h:.1f}" width="{bw * 0.9:.1f}" height="{h:.1f}" '
                       f'fill="{colors[s % 3]}"/>')
            out.append(f'<text x="{x + bw * 0.45:.1f}" y="{base - h - 4:.1f}" text-anchor="middle">{v:.0f}</text>')
        out.append(f'<text x="{left + g * slot + slot / 2:.1f}" y="{base + 16}" text-anchor="middle">{label}</text>')
    names = [name for name, _ in groups[0][1]]
    for s, name in enumerate(names):
        out.append(f'<rect x="{left + s * 150}" y="{height - 16}" width="10" height="10" fill="{colors[s % 3]}"/>')
        out.append(f'<text x="{left + s * 150 + 14}" y="{height - 7}">{name}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--checkpoint", default="models/demo-chat")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json")
    p.add_argument("--svg")
    args = p.parse_args()
    asyncio.run(chat_load(args.url, 2, 8))      # warm-up
    service = {n: asyncio.run(chat_load(args.url, n, args.max_tokens)) for n in (1, 8, 32)}
    decisions = asyncio.run(decision_load(args.url, 32, 4))
    server, thread, base_url = start_baseline(args.checkpoint)
    try:
        asyncio.run(chat_load(base_url, 1, 8))
        baseline = {n: asyncio.run(chat_load(base_url, n, args.max_tokens)) for n in (1, 32)}
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    result = {"machine": f"{platform.machine()}, {platform.python_version()}", "max_tokens": args.max_tokens,
              "service": service, "decisions": decisions, "baseline": baseline,
              "speedup_32": service[32]["tokens_per_s"] / baseline[32]["tokens_per_s"],
              "ttft_32_over_1": service[32]["ttft_p50_ms"] / service[1]["ttft_p50_ms"]}
    print(f"{'chat':14}{'streams':>8}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}")
    for name, runs in (("service", service), ("baseline", baseline)):
        for n, r in runs.items():
            itl50 = f"{r['itl_p50_ms']:9.1f}" if r["itl_p50_ms"] is not None else f"{'-':>9}"
            itl99 = f"{r['itl_p99_ms']:9.1f}" if r["itl_p99_ms"] is not None else f"{'-':>9}"
            print(f"{name:14}{n:8d}{r['tokens_per_s']:9.1f}{r['ttft_p50_ms']:10.1f}{r['ttft_p99_ms']:10.1f}"
                  f"{itl50}{itl99}")
    print(f"decisions: 32 clients, {decisions['questions_per_s']:.1f} questions/s, p50 {decisions['p50_ms']:.1f} ms, "
          f"p99 {decisions['p99_ms']:.1f} ms")
    print(f"32 streams vs baseline: {result['speedup_32']:.1f}x tokens/s; TTFT p50 at 32 streams / 1 stream: "
          f"{result['ttft_32_over_1']:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.svg:
        svg_bars(args.svg, "aggregate chat tokens/s by concurrent streams",
                 [(f"{n} stream{'s' if n > 1 else ''}", [("service", service[n]["tokens_per_s"])]
                   + ([("seed-001 baseline", baseline[n]["tokens_per_s"])] if n in baseline else
                      [("seed-001 baseline", 0.0)])) for n in (1, 8, 32)])


if __name__ == "__main__":
    main()
