"""Goodput under overload: closed-loop chat clients at 1x, 2x and 4x the load that saturates the service.

    .venv/bin/startlux serve &
    python -m bench.overload [--url http://127.0.0.1:8000] [--saturation 32] [--seconds 20] [--max-tokens 64]
                             [--ttft-slo-ms 1000] [--tpot-slo-ms 100] [--client lean|plain] [--no-stream]
                             [--session PID] [--json out.json]

Each client streams one short question after another (the `question` workload of bench/http.py, greedy-free
sampling, up to --max-tokens tokens) for --seconds. A 503 is retried: `honour` waits the Retry-After the
service sent, `immediate` resends at once (a retry storm). Reported per run: goodput (tokens/s of completed
requests), requests completed, 503s received, and goodput under an SLO as vLLM's benchmark defines it (the
tokens/s of the requests whose time to first token and mean time per output token both meet the bounds).
`--saturation` is the concurrency the service saturates at (its engine's rows: `chat_max_rows`).
`--client plain` sends with httpx, one AsyncClient per client, as an ordinary application would (`lean`, the
default, is bench/sse.py's minimal client, which costs the shared CPU less); `--no-stream` asks for whole
responses, whose time to first token is the whole request and whose SLO is met when it ends within
ttft + tpot x tokens. `--session` (the pid of a `serve run` started with setsid) adds each process's CPU
seconds in each run, the load generator's own among them. Goodput counts `usage.completion_tokens` (a
stream's usage chunk, which may report tokens that completed no character); a stream's time per output token
is the time from its first output chunk to its last over its tokens after the first.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import platform
import resource
import time

import httpx

from bench.http import PROMPTS
from bench.path_profile import TICK, cpu_ticks, name_of, session_pids
from bench.sse import Connection, HTTPStatusError, StreamTally


class Refused(Exception):
    def __init__(self, retry_after: float):
        self.retry_after = retry_after


class LeanClient:
    """bench/sse.py's client: one connection, reused."""

    def __init__(self, url):
        self.conn = Connection(url)

    async def send(self, body) -> tuple[list[float], int]:
        """-> (arrival times of the chunks with output, completion tokens)."""
        tally, lines = StreamTally(), []
        try:
            async for line in self.conn.post_lines("/v1/chat/completions", body):
                if body["stream"]:
                    tally.line(line)
                else:
                    lines.append(line)
        except HTTPStatusError as e:
            if e.status != 503:
                raise
            raise Refused(float(e.headers.get("retry-after", 1))) from None
        if body["stream"]:
            return tally.times, tally.tokens
        return [], json.loads("".join(lines))["usage"]["completion_tokens"]

    async def close(self):
        self.conn.close()


class PlainClient:
    """httpx, as an ordinary application sends."""

    def __init__(self, url):
        self.client = httpx.AsyncClient(base_url=url, timeout=600)

    async def send(self, body) -> tuple[list[float], int]:
        if not body["stream"]:
            r = await self.client.post("/v1/chat/completions", json=body)
            if r.status_code == 503:
                raise Refused(float(r.headers.get("retry-after", 1)))
            r.raise_for_status()
            return [], r.json()["usage"]["completion_tokens"]
        tally = StreamTally()
        async with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code == 503:
                await r.aread()
                raise Refused(float(r.headers.get("retry-after", 1)))
            r.raise_for_status()
            async for line in r.aiter_lines():
                tally.line(line)
        return tally.times, tally.tokens

    async def close(self):
        await self.client.aclose()


CLIENTS = {"lean": LeanClient, "plain": PlainClient}


async def client_loop(conn, deadline, max_tokens, mode, seed, out, stream=True):
    i = 0
    try:
        while time.perf_counter() < deadline:
            body = {"messages": [{"role": "user", "content": PROMPTS[(seed + i) % len(PROMPTS)]}],
                    "max_tokens": max_tokens, "stream": stream, "temperature": 1.0, "seed": seed * 10_000 + i,
                    **({"stream_options": {"include_usage": True}} if stream else {})}
            i += 1
            t0 = time.perf_counter()
            try:
                times, tokens = await conn.send(body)
            except Refused as e:
                out["rejected"] += 1
                if mode == "honour":
                    await asyncio.sleep(e.retry_after)
                continue
            end = time.perf_counter()
            if end > deadline:
                continue
            if stream and times:
                out["done"].append((times[0] - t0, (times[-1] - times[0]) / max(1, tokens - 1), tokens))
            elif not stream and tokens:
                out["done"].append((end - t0, None, tokens))
    finally:
        await conn.close()


async def run(url, clients, seconds, max_tokens, mode, client="lean", stream=True, started=None):
    """`clients` closed-loop clients for `seconds`; each client object is made first, outside the timed run
    (an httpx client builds an SSL context when made: tens of milliseconds of CPU that an application spends
    once). `started()` is called as the timed run begins."""
    out = {"rejected": 0, "done": []}
    conns = [CLIENTS[client](url) for _ in range(clients)]
    if started:
        started()
    deadline = time.perf_counter() + seconds
    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop(conn, deadline, max_tokens, mode, c, out, stream)
                           for c, conn in enumerate(conns)))
    return out, time.perf_counter() - t0


class CpuMark:
    """CPU seconds per process group of the service (`pids`), and this load generator's own, from `start()`
    (passed to `run` as `started`, so the clients' making is not counted) to `seconds()`."""

    def __init__(self, pids: list[int]):
        self.pids = pids

    def start(self) -> None:
        self.before, self.own = cpu_ticks(self.pids), resource.getrusage(resource.RUSAGE_SELF)

    def seconds(self) -> dict[str, float]:
        per = collections.defaultdict(float)
        for pid, t in cpu_ticks(self.pids).items():
            per[name_of(pid)] += (t - self.before.get(pid, t)) / TICK
        now = resource.getrusage(resource.RUSAGE_SELF)
        per["load generator"] = now.ru_utime + now.ru_stime - self.own.ru_utime - self.own.ru_stime
        return dict(per)


def meets_slo(ttft_s, tpot_s, tokens, ttft_slo_ms, tpot_slo_ms) -> bool:
    """vLLM's SLO goodput rule; a whole response (tpot None) must end within ttft + tpot x tokens."""
    if tpot_s is None:
        return ttft_s * 1000 <= ttft_slo_ms + tpot_slo_ms * tokens
    return ttft_s * 1000 <= ttft_slo_ms and tpot_s * 1000 <= tpot_slo_ms


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
    p.add_argument("--client", choices=sorted(CLIENTS), default="lean")
    p.add_argument("--no-stream", action="store_true", help="whole responses instead of streams")
    p.add_argument("--session", type=int, help="the service's session id (the pid of its `serve run`, started "
                                               "with setsid): each run then reports every process's CPU")
    p.add_argument("--json")
    args = p.parse_args()
    httpx.get(f"{args.url}/healthz", timeout=10).raise_for_status()
    results = []
    print(f"{'mode':10}{'clients':>8}{'goodput tok/s':>15}{'SLO goodput':>13}{'done':>7}{'503s':>8}"
          f"{'TTFT p50':>10}")
    for mode in args.modes:
        for f in args.factors:
            clients = f * args.saturation
            mark = CpuMark(session_pids(args.session) if args.session else [])
            out, wall = asyncio.run(run(args.url, clients, args.seconds, args.max_tokens, mode, args.client,
                                        not args.no_stream, mark.start))
            cpu = mark.seconds()
            done = out["done"]
            tokens = sum(n for _, _, n in done)
            ok = [n for ttft, tpot, n in done if meets_slo(ttft, tpot, n, args.ttft_slo_ms, args.tpot_slo_ms)]
            ttfts = sorted(t for t, _, _ in done)
            r = {"mode": mode, "client": args.client, "stream": not args.no_stream, "clients": clients, "factor": f,
                 "seconds": wall, "completed": len(done),
                 "rejected": out["rejected"], "goodput_tokens_per_s": tokens / wall,
                 "slo_goodput_tokens_per_s": sum(ok) / wall,
                 "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2] if ttfts else None, "cpu_s": cpu}
            results.append(r)
            print(f"{mode:10}{clients:8d}{r['goodput_tokens_per_s']:15.1f}{r['slo_goodput_tokens_per_s']:13.1f}"
                  f"{len(done):7d}{out['rejected']:8d}{(r['ttft_p50_ms'] or 0):10.1f}", flush=True)
            if args.session:
                busiest = sorted(cpu.items(), key=lambda kv: -kv[1])
                print("    CPU s: " + ", ".join(f"{k} {v:.2f}" for k, v in busiest))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": f"{platform.machine()}, {platform.python_version()}", "slo": {
                "ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms}, "runs": results}, f, indent=2)


if __name__ == "__main__":
    main()
