"""HTTP benchmark of /v1/systemone with the client-shaped decision workload of bench/decision.py.

    .venv/bin/startlux serve &
    python -m bench.systemone [--url http://127.0.0.1:8000] [--clients 1,32] [--per-client 4]
                              [--checkpoint models/demo-decision] [--label NAME] [--json out.json]

Closed-loop clients: each sends its next request as soon as its previous one is answered; client i sends
requests i, i + clients, ... of one workload (`bench.decision.client_workload`, states sized with the
checkpoint's tokenizer), so the share of repeated states is the same at every concurrency. Reports questions/s
of answered requests and request latency p50/p99 per concurrency, and the share of prompt tokens the service
reported as cached.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time

import httpx

from bench.decision import client_workload, count_questions


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def load(url: str, reqs: list[dict], clients: int) -> dict:
    latencies, cached, tokens = [], 0, 0

    async def worker(client, mine):
        nonlocal cached, tokens
        for body in mine:
            t0 = time.perf_counter()
            r = await client.post(f"{url}/v1/systemone", json=body)
            r.raise_for_status()
            latencies.append(time.perf_counter() - t0)
            usage = r.json()["usage"]
            tokens += usage["input_tokens"]
            cached += usage.get("input_tokens_details", {}).get("cached_tokens", 0)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client, reqs[i::clients]) for i in range(clients)))
        wall = time.perf_counter() - t0
    return {"clients": clients, "requests": len(reqs), "questions": count_questions(reqs), "seconds": wall,
            "questions_per_s": count_questions(reqs) / wall, "p50_ms": 1000 * pct(latencies, 0.5),
            "p99_ms": 1000 * pct(latencies, 0.99), "cached_share": cached / tokens if tokens else 0.0}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--clients", default="1,32")
    p.add_argument("--per-client", type=int, default=4)
    p.add_argument("--checkpoint", default="models/demo-decision")
    p.add_argument("--label", default="service")
    p.add_argument("--json")
    args = p.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.checkpoint)
    httpx.get(f"{args.url}/healthz", timeout=10).raise_for_status()
    results = []
    for n, clients in enumerate(int(c) for c in args.clients.split(",")):
        # a workload of its own per concurrency (another seed): no state is already cached from the run before
        reqs = client_workload(clients * args.per_client, seed=100 + n,
                               count=lambda t: len(tok.encode(t, add_special_tokens=False)))
        r = asyncio.run(load(args.url, reqs, clients))
        results.append(r)
        print(f"{args.label:12} {clients:3d} clients: {r['questions_per_s']:7.1f} questions/s, p50 {r['p50_ms']:7.0f} ms, "
              f"p99 {r['p99_ms']:7.0f} ms, cached {100 * r['cached_share']:4.1f}% of prompt tokens", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"label": args.label, "machine": f"{platform.machine()}, {platform.python_version()}",
                       "runs": results}, f, indent=2)


if __name__ == "__main__":
    main()
