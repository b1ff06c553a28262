"""HTTP benchmark of the running service, against a seed-001-style baseline on the same checkpoint.

    .venv/bin/startlux serve &
    python -m bench.http [--url http://127.0.0.1:8000] [--direct-url http://127.0.0.1:30000]
                         [--checkpoint models/demo-chat] [--per-client 16] [--baseline-per-client 4]
                         [--json out.json] [--svg bench/http.svg]

Chat with 1, 8 and 32 concurrent streams (time to first token and inter-token latency p50/p99, time per
output token p50, aggregate tokens/s), through port 8000 (--url: HAProxy with the README's command, Serve's Python proxy without
RAY_SERVE_ENABLE_HA_PROXY) and, with --direct-url, straight to the Ingress replica's own HTTP server (the
port HAProxy forwards to; `ss -ltnp` shows it, 30000 when it was free), on three
workloads: `question` (a single question), `history` (six earlier exchanges, then a question) and
`long` (a single question with `ignore_eos`, so every answer runs to --max-tokens tokens, as vLLM's
benchmarks do; tokens past the end of the turn show no text and are counted on neither side). Each
stream is a client that sends its next request when the previous one ends (`--per-client` requests,
16: the first round, which arrives as one burst, is then a sixteenth of the samples), so concurrency
holds steady. Then `multiturn` (each client continues its own conversation for 8 turns, resending the whole history every
turn, as chat UIs do; `--multiturn-only` runs just this one, to compare services started with and without
`chat_prefix_caching`), then decisions with 32 concurrent clients (questions/s, p50/p99), and the same chat runs
against the baseline (one generation at a time under a lock, no KV cache; bench/baseline.py) started
here on another port; it serves one request at a time, so its runs use fewer (`--baseline-per-client`).
Tokens are the completion tokens of each stream's usage chunk (the service may put several tokens in one
chunk; the baseline sends one per chunk and no usage, so its output chunks are counted); ITL is the time
between chunks with output (text, or a calculator call or result), TPOT a stream's mean time per token after
its first (vLLM's benchmark's definitions). Chat streams go through bench/sse.py, a lean client (the load generator shares the CPU with the service);
the JSON output has this process's CPU per request for each run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import socket
import threading
import time

import httpx

from bench.sse import Connection, StreamTally

PROMPTS = ["hello", "What is the capital of France?", "What is 1234 times 56?", "Capital of Peru?"]


def conversations(n: int, turns: int, seed: int = 7) -> list[list[dict]]:
    """Chat histories from the demo domain: `turns` earlier exchanges, then a new question (turns=0: just one
    question). A longer history is where a KV cache pays: the baseline re-reads it for every token."""
    from tools import demo_data as D

    rng = random.Random(seed)
    out = []
    for i in range(n):
        msgs = []
        for _ in range(turns):
            q, parts, _ = (D.fact_turn if rng.random() < 0.5 else D.math_turn)(rng)
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": parts}]
        if turns:
            q, _, _ = (D.fact_turn if rng.random() < 0.5 else D.math_turn)(rng)
        else:
            q = PROMPTS[i % len(PROMPTS)]
        out.append(msgs + [{"role": "user", "content": q}])
    return out


def pct(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def one_stream(conn, messages, seed, max_tokens, ignore_eos=False):
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 1.0, "seed": seed,
            "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}}
    t0, tally = time.perf_counter(), StreamTally()
    async for line in conn.post_lines("/v1/chat/completions", body):
        tally.line(line)
    return t0, tally


async def chat_load(url, clients, max_tokens, per_client=4, turns=0, ignore_eos=False):
    """`clients` concurrent streams, closed loop: each client sends its next request when the previous one
    has finished, `per_client` times, so the service holds about `clients` streams throughout (arrivals
    spread out after the first round, as with real users) instead of one burst. Each client keeps one
    connection (bench/sse.py, a lean client: the load generator shares the CPU with the service)."""
    histories = conversations(clients * per_client, turns)

    async def client_loop(c):
        conn = Connection(url)
        try:
            return [await one_stream(conn, histories[c * per_client + j], c * per_client + j, max_tokens, ignore_eos)
                    for j in range(per_client)]
        finally:
            conn.close()

    t0, cpu0 = time.perf_counter(), time.process_time()
    results = [r for rs in await asyncio.gather(*(client_loop(c) for c in range(clients))) for r in rs]
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    ttft = [t.times[0] - start for start, t in results if t.times]
    itl = [b - a for _, t in results for a, b in zip(t.times, t.times[1:])]
    tpot = [x for _, t in results if (x := t.tpot()) is not None]
    tokens = sum(t.tokens for _, t in results)
    # the CPU this process spent per request: the load generator's own cost (plus the baseline server's,
    # which runs in this process)
    return {"streams": clients, "requests": len(results), "tokens": tokens, "seconds": wall,
            "tokens_per_s": tokens / wall, "process_cpu_ms_per_request": 1000 * cpu / len(results),
            "ttft_p50_ms": 1000 * pct(ttft, 0.5), "ttft_p99_ms": 1000 * pct(ttft, 0.99),
            "itl_p50_ms": 1000 * pct(itl, 0.5) if itl else None, "itl_p99_ms": 1000 * pct(itl, 0.99) if itl else None,
            "tpot_p50_ms": 1000 * pct(tpot, 0.5) if tpot else None}


async def decision_load(url, clients, per_client):
    body = {"state": "the cat is red and the dog is blue",
            "questions": {"color": {"instructions": "which color is the cat", "criteria": {"r": "red", "b": "blue"}},
                          "cat": {"type": "noul", "instructions": "is there a cat"},
                          "size": {"type": "score", "instructions": "how big", "criteria": ["small", "medium", "big"]}}}
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


async def multiturn_stream(conn, messages, seed, max_tokens):
    """One streamed turn; -> (t0, output times, the reply as parts)."""
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 1.0, "seed": seed,
            "stream_options": {"include_usage": True}}
    t0, tally, parts = time.perf_counter(), StreamTally(), []
    async for line in conn.post_lines("/v1/chat/completions", body):
        tally.line(line)
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            delta = chunk["choices"][0]["delta"] if chunk.get("choices") else {}
            if delta.get("content"):
                if parts and parts[-1]["type"] == "text":
                    parts[-1]["text"] += delta["content"]
                else:
                    parts.append({"type": "text", "text": delta["content"]})
            parts.extend(delta.get("parts") or [])
    return t0, tally, parts


async def multiturn_load(url, clients, turns, max_tokens, seed=11):
    """Each client continues its own conversation for `turns` turns (demo-domain questions), resending the whole
    history, its own replies with their calculator parts included, every turn, as chat UIs do."""
    from tools import demo_data as D

    async def client_loop(c):
        rng = random.Random(seed * 1000 + c)
        conn, history, out = Connection(url), [], []
        try:
            for turn in range(turns):
                q, _, _ = (D.fact_turn if rng.random() < 0.5 else D.math_turn)(rng, follow=turn > 0)
                history.append({"role": "user", "content": q})
                t0, tally, parts = await multiturn_stream(conn, history, c * turns + turn, max_tokens)
                out.append((t0, tally))
                text = "".join(p["text"] for p in parts if p["type"] == "text")
                history.append({"role": "assistant", "content": text, "parts": parts})
        finally:
            conn.close()
        return out

    t0 = time.perf_counter()
    results = [r for rs in await asyncio.gather(*(client_loop(c) for c in range(clients))) for r in rs]
    wall = time.perf_counter() - t0
    ttft = [t.times[0] - start for start, t in results if t.times]
    tokens = sum(t.tokens for _, t in results)
    return {"streams": clients, "requests": len(results), "tokens": tokens, "seconds": wall,
            "tokens_per_s": tokens / wall, "ttft_p50_ms": 1000 * pct(ttft, 0.5), "ttft_p99_ms": 1000 * pct(ttft, 0.99)}


def prefix_counters(url) -> tuple[int, int]:
    s = httpx.get(f"{url}/debug/stats", timeout=10).json()["chat"].get("prefix_cache", {})
    return s.get("query_tokens", 0), s.get("hit_tokens", 0)


def run_multiturn(url, max_tokens, turns=8, streams=(1, 32)) -> dict:
    """The multiturn workload at each concurrency, with the prompt tokens the chat replica computed (its prefix
    counters before and after; read after its idle report)."""
    out = {}
    for n in streams:
        time.sleep(0.6)
        q0, h0 = prefix_counters(url)
        r = asyncio.run(multiturn_load(url, n, turns, max_tokens))
        time.sleep(0.6)
        q1, h1 = prefix_counters(url)
        out[n] = r | {"prompt_tokens_computed": (q1 - q0) - (h1 - h0)}
    return out


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
    width, height, left, top = 760, 300, 60, 40
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


# name: (earlier exchanges before the new question, ignore_eos: always generate --max-tokens tokens)
WORKLOADS = {"question": (0, False), "history": (6, False), "long": (0, True)}


def run_chat(url, max_tokens, per_client, streams):
    return {name: {n: asyncio.run(chat_load(url, n, max_tokens, per_client, turns, ignore_eos)) for n in streams}
            for name, (turns, ignore_eos) in WORKLOADS.items()}


def row(name, workload, n, r):
    cell = lambda v: f"{v:9.1f}" if v is not None else f"{'-':>9}"   # noqa: E731
    return (f"{name:10}{workload:10}{n:8d}{r['tokens_per_s']:9.1f}{r['ttft_p50_ms']:10.1f}{r['ttft_p99_ms']:10.1f}"
            f"{cell(r['itl_p50_ms'])}{cell(r['itl_p99_ms'])}{cell(r.get('tpot_p50_ms'))}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--checkpoint", default="models/demo-chat")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--direct-url", help="the Ingress replica's own HTTP server (direct ingress, no proxy hop), "
                                        "e.g. http://127.0.0.1:30000: also measured when given")
    p.add_argument("--per-client", type=int, default=16, help="requests each concurrent client sends in turn")
    p.add_argument("--baseline-per-client", type=int, default=4,
                   help="the same for the baseline, which serves one request at a time (so fewer suffice)")
    p.add_argument("--json")
    p.add_argument("--svg")
    p.add_argument("--multiturn-only", action="store_true",
                   help="only the multiturn workload (8-turn conversations, 1 and 32 clients) against --url")
    args = p.parse_args()
    for url in filter(None, (args.url, args.direct_url)):   # fail now, not after minutes of load on the other
        try:
            httpx.get(f"{url}/healthz", timeout=10).raise_for_status()
        except httpx.HTTPError as e:
            p.error(f"{url} does not answer /healthz ({e}); with RAY_SERVE_ENABLE_HA_PROXY the Ingress replica's "
                    "own port is in the 30000-31000 range (ss -ltnp shows it)")
    asyncio.run(chat_load(args.url, 2, 8, 1))      # warm-up
    if args.multiturn_only:
        multi = run_multiturn(args.url, args.max_tokens)
        for n, r in multi.items():
            print(f"multiturn {n:3d} streams: {r['tokens_per_s']:8.1f} tokens/s, TTFT p50 {r['ttft_p50_ms']:6.1f} ms, "
                  f"p99 {r['ttft_p99_ms']:6.1f} ms, prompt tokens computed {r['prompt_tokens_computed']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"machine": f"{platform.machine()}, {platform.python_version()}", "multiturn": multi}, f,
                          indent=2)
        return
    service = run_chat(args.url, args.max_tokens, args.per_client, (1, 8, 32))
    multi = run_multiturn(args.url, args.max_tokens)
    decisions = asyncio.run(decision_load(args.url, 32, 4))
    direct = None
    if args.direct_url:
        asyncio.run(chat_load(args.direct_url, 2, 8, 1))
        direct = run_chat(args.direct_url, args.max_tokens, args.per_client, (1, 8, 32))
    server, thread, base_url = start_baseline(args.checkpoint)
    try:
        asyncio.run(chat_load(base_url, 1, 8, 1))
        baseline = run_chat(base_url, args.max_tokens, args.baseline_per_client, (1, 32))
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    result = {"machine": f"{platform.machine()}, {platform.python_version()}", "max_tokens": args.max_tokens,
              "per_client": args.per_client, "baseline_per_client": args.baseline_per_client, "workloads": WORKLOADS, "service": service, "direct": direct,
              "decisions": decisions, "baseline": baseline, "multiturn": multi}
    runs = {"service": service} | ({"direct": direct} if direct else {})
    result["speedup_32"] = {f"{name} {w}": r[w][32]["tokens_per_s"] / baseline[w][32]["tokens_per_s"]
                            for name, r in runs.items() for w in WORKLOADS}
    result["ttft_32_over_1"] = {f"{name} {w}": r[w][32]["ttft_p50_ms"] / r[w][1]["ttft_p50_ms"]
                                for name, r in runs.items() for w in WORKLOADS}
    print(f"{'chat':10}{'workload':10}{'streams':>8}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}"
          f"{'ITL p99':>9}{'TPOT p50':>9}")
    for name, r in (runs | {"baseline": baseline}).items():
        for w in WORKLOADS:
            for n, one in r[w].items():
                print(row(name, w, n, one))
    print(f"decisions: 32 clients, {decisions['questions_per_s']:.1f} questions/s, p50 {decisions['p50_ms']:.1f} ms, "
          f"p99 {decisions['p99_ms']:.1f} ms")
    for key in result["speedup_32"]:
        print(f"{key}: 32 streams vs baseline {result['speedup_32'][key]:.1f}x tokens/s; TTFT p50 at 32 streams / "
              f"1 stream {result['ttft_32_over_1'][key]:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.svg:
        groups = [(f"{w} x{n}",
                   [(name, r[w][n]["tokens_per_s"]) for name, r in runs.items()]
                   + [("seed-001 baseline", baseline[w][n]["tokens_per_s"])])
                  for w in WORKLOADS for n in (1, 32)]
        svg_bars(args.svg, "aggregate chat tokens/s by workload x concurrent streams (demo-chat, 2-core CPU)", groups)


if __name__ == "__main__":
    main()
