"""The serving path's capacity at a GPU's token rate: the service with the synthetic engine, CPU per token per process.

    python -m bench.relay [--seconds 10] [--only chat-32 ...] [--json out.json] [--set KEY=VALUE ...]

On a GPU node the model is ten to fifty times faster than on this CPU and the serving processes are not, so
what one chat replica and one Ingress can relay is measured here with the engine that generates without a
model (`chat_engine: synthetic`, core/chat/synthetic.py): every running row gets one real token of the demo
checkpoint's tokenizer per step, a step takes `rows / rate` seconds. Everything else is the README's service
(serve_config.cpu.yaml's application, HAProxy in front, the engine in its own process).

Each service setting (rows, rate) is started once and runs its scenarios: `--seconds` of closed-loop clients
(each sends its next streamed request when the last one ends, `max_tokens` tokens each, `ignore_eos`), after
a short warm-up. Tokens are the completion tokens the usage chunks report; the CPU of every process of the
service is read from /proc over the same window (the load generator's own CPU is this process's, reported
apart). Per scenario: tokens/s delivered, microseconds of CPU per token for HAProxy, the Ingress, the chat
replica (with the engine client's reader thread), the engine process, the Serve proxy, the rest, and
`serving` = HAProxy + Ingress + chat replica + Serve proxy, the path the targets are about; and what each
process would relay on a core of its own (1e6 / its microseconds per token).

The settings: `h200-32` (32 rows, 25,600 tokens/s: an H200's rate on the demo model at 32 streams),
`h200-256` (256 rows at the same total rate), `max-512` (512 rows at one token per row per 1.25 ms: more
than the path can take, so the path's ceiling). The scenarios: streamed chat and completions, with and
without logprobs (top 2), n=4 (a quarter of the clients, four samples each).

`--floor` runs the plain chat scenarios against bench.serve_floor's bare Serve app instead, paced as each
setting's engine: a request's first token through a Serve call, the rest written by the bare Ingress at the
hold `--set` gives (the GPU config's 64 tokens or 50 ms by default), nothing else: what a design that keeps a
Serve call per request and an SSE write per message costs at the least.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import resource
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.path_profile import TICK, cpu_ticks, name_of, profile_processes, session_pids
from bench.sse import Connection, HTTPStatusError
from bench.serve_floor import start_bare
from bench.vllm_peer import ROOT, app_overrides, start_ours

CHECKPOINT = ROOT / "models" / "demo-chat"
SERVING = ("HAProxy", "Ingress replica", "chat replica", "Serve proxy")
SHOWN = SERVING + ("chat engine process",)
LABELS = {"HAProxy": "HAProxy", "Ingress replica": "Ingress", "chat replica": "chat", "Serve proxy": "proxy",
          "chat engine process": "engine"}


@dataclass(frozen=True)
class Setting:
    name: str
    rows: int
    rate: float                  # tokens/s with every row running

    @property
    def step_s(self) -> float:
        return self.rows / self.rate


@dataclass(frozen=True)
class Scenario:
    name: str
    setting: str
    streams: int                 # rows in use: clients x n
    route: str = "chat"          # chat | completions
    logprobs: bool = False
    n: int = 1
    max_tokens: int = 256


SETTINGS = {s.name: s for s in (Setting("h200-32", 32, 25_600), Setting("h200-256", 256, 25_600),
                                Setting("max-512", 512, 512 / 0.00125))}
SCENARIOS = [
    Scenario("chat-32", "h200-32", 32), Scenario("completions-32", "h200-32", 32, "completions"),
    Scenario("chat-32-logprobs", "h200-32", 32, logprobs=True),
    Scenario("completions-32-logprobs", "h200-32", 32, "completions", logprobs=True),
    Scenario("chat-32-n4", "h200-32", 32, n=4),
    Scenario("chat-256", "h200-256", 256), Scenario("completions-256", "h200-256", 256, "completions"),
    Scenario("chat-256-max", "max-512", 256), Scenario("chat-512-max", "max-512", 512),
]

PROMPT = "Tell me a story about the sea, the harbour and the people who work there."


def body(sc: Scenario, i: int) -> tuple[str, dict]:
    common = {"max_tokens": sc.max_tokens, "stream": True, "stream_options": {"include_usage": True},
              "ignore_eos": True, "seed": i, "n": sc.n}
    if sc.route == "chat":
        b = {"messages": [{"role": "user", "content": PROMPT}], **common}
        if sc.logprobs:
            b.update(logprobs=True, top_logprobs=2)
        return "/v1/chat/completions", b
    b = {"prompt": PROMPT, **common}
    if sc.logprobs:
        b["logprobs"] = 2
    return "/v1/completions", b


async def one(conn: Connection, path: str, payload: dict, gaps: list[float]) -> tuple[int, float]:
    """One streamed request -> (completion tokens from its usage chunk, seconds to its first body piece); the
    time between body pieces after the first (what a client sees between tokens) goes into `gaps`. The body is
    not parsed as it arrives: the load generator shares the cores with the service."""
    t0, first, tail = time.perf_counter(), None, b""
    last = t0
    async for piece in conn.post_pieces(path, payload):
        now = time.perf_counter()
        if first is None:
            first = now - t0
        else:
            gaps.append(now - last)
        last = now
        tail = (tail + piece)[-8192:]
    start = tail.rfind(b"data: {", 0, tail.rfind(b"data: [DONE]"))
    usage = json.loads(tail[start + 6:tail.index(b"\n", start)])["usage"]
    return usage["completion_tokens"], first or 0.0


async def load(url: str, sc: Scenario, seconds: float) -> dict:
    clients = sc.streams // sc.n
    tokens, ttfts, gaps, requests, refused = 0, [], [], 0, {}
    deadline = time.perf_counter() + seconds

    async def client(c: int) -> None:
        nonlocal tokens, requests
        conn = Connection(url)
        k = 0
        try:
            while time.perf_counter() < deadline:
                try:
                    n, ttft = await one(conn, *body(sc, c * 100_000 + k), gaps)
                except HTTPStatusError as e:         # counted and retried shortly: the run reports them
                    refused[e.status] = refused.get(e.status, 0) + 1
                    await asyncio.sleep(0.05)
                    continue
                tokens, requests, k = tokens + n, requests + 1, k + 1
                ttfts.append(ttft)
        finally:
            conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    wall = time.perf_counter() - t0
    ttfts.sort()
    gaps.sort()
    return {"tokens": tokens, "requests": requests, "refused": refused, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2] if ttfts else None,
            "itl_p50_ms": 1000 * gaps[len(gaps) // 2] if gaps else None,
            "itl_p99_ms": 1000 * gaps[int(len(gaps) * 0.99)] if gaps else None}


def own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(server, sc: Scenario, seconds: float) -> dict:
    asyncio.run(load(server.url, Scenario(sc.name, sc.setting, min(sc.streams, 32), sc.route, sc.logprobs, sc.n,
                                          32), 1.0))             # warm-up
    pids = session_pids(server.proc.pid)
    before, me = cpu_ticks(pids), own_cpu()
    run = asyncio.run(load(server.url, sc, seconds))
    after, me = cpu_ticks(pids), own_cpu() - me
    per = collections.defaultdict(float)
    for pid, t in after.items():
        per[name_of(pid)] += (t - before.get(pid, t)) / TICK
    us = {name: 1e6 * cpu / max(run["tokens"], 1) for name, cpu in per.items()}
    return {**run, "cpu_s": dict(per), "us_per_token": us, "load_generator_us": 1e6 * me / max(run["tokens"], 1),
            "serving_us": sum(us.get(n, 0.0) for n in SERVING)}


def profile(server, sc: Scenario, py_spy: str, seconds: int) -> dict:
    """py-spy's hottest functions of each serving Python process while `sc` runs (a load of its own)."""
    return profile_processes(
        py_spy, session_pids(server.proc.pid), ("Ingress replica", "chat replica", "chat engine process"),
        lambda: threading.Thread(target=asyncio.run, args=(load(server.url, sc, seconds + 6),)), seconds,
        top=40, gil=True, label=f"{sc.name}: ")


def service_args(setting: Setting, extra: dict) -> tuple[dict, dict]:
    inflight = setting.rows + 16
    args = {"chat_engine": "synthetic", "chat_synthetic_step_s": setting.step_s, "chat_max_rows": setting.rows,
            "max_chat_inflight": inflight, "max_chat_waiting": 64, **extra}
    deployments = {"ChatModel": {"max_ongoing_requests": inflight, "max_queued_requests": 64},
                   "Ingress": {"max_ongoing_requests": inflight + 64, "max_queued_requests": 256}}
    return args, deployments


def table(results: dict) -> str:
    head = (f"{'scenario':26}{'tok/s':>9}{'TTFT ms':>9}{'ITL p50':>9}{'ITL p99':>9}"
            + "".join(f"{LABELS[n]:>9}" for n in SHOWN)
            + f"{'rest':>8}{'serving':>9}{'client':>8}")
    lines = [head, "  (CPU microseconds per token; chat = chat replica with the engine client, "
                   "engine = engine process)"]
    for name, r in results.items():
        us = r["us_per_token"]
        rest = sum(v for k, v in us.items() if k not in SHOWN)
        lines.append(f"{name:26}{r['tokens_per_s']:9.0f}{r['ttft_p50_ms'] or 0:9.1f}{r['itl_p50_ms'] or 0:9.1f}"
                     f"{r['itl_p99_ms'] or 0:9.1f}"
                     + "".join(f"{us.get(n, 0.0):9.1f}" for n in SHOWN)
                     + f"{rest:8.1f}{r['serving_us']:9.1f}{r['load_generator_us']:8.1f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--only", nargs="*", help="scenario names (default: all)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an application argument over the benchmark's (YAML value), e.g. chat_stream_interval=8")
    p.add_argument("--py-spy", help="py-spy's path: profile each scenario's Python processes after measuring it")
    p.add_argument("--profile-seconds", type=int, default=10)
    p.add_argument("--floor", action="store_true",
                   help="instead of the service, bench.serve_floor's bare Serve app paced as the setting's engine "
                        "(first token through Serve, the rest written by its Ingress at the hold --set gives, "
                        "default the GPU config's 64 tokens or 50 ms): the least any design that keeps a Serve call "
                        "per request and an SSE write per message can cost")
    p.add_argument("--json")
    args = p.parse_args()
    chosen = [sc for sc in SCENARIOS if not args.only or sc.name in args.only]
    if args.floor and any(sc.route != "chat" or sc.logprobs or sc.n != 1 for sc in chosen):
        p.error("--floor paces plain streams only: choose chat-32, chat-256, chat-256-max or chat-512-max")
    results = {}
    for setting in dict.fromkeys(sc.setting for sc in chosen):
        s = SETTINGS[setting]
        app, deployments = service_args(s, app_overrides(args.set))
        work = Path(tempfile.mkdtemp(prefix="relay-"))
        if args.floor:
            every, every_s = app.get("chat_stream_interval", 64), app.get("chat_stream_interval_s", 0.05)
            hold = min(every, max(1, round(every_s / s.step_s))) if every_s else every
            server = start_bare(work, hold, s.step_s)
        else:
            server = start_ours(CHECKPOINT, work, app, deployments=deployments)
        try:
            server.wait_ready()
            for sc in (sc for sc in chosen if sc.setting == setting):
                results[sc.name] = measure(server, sc, args.seconds)
                print(f"{sc.name}: {results[sc.name]['tokens_per_s']:.0f} tokens/s, serving "
                      f"{results[sc.name]['serving_us']:.1f} us/token, refused {results[sc.name]['refused']}",
                      flush=True)
                if args.py_spy:
                    results[sc.name]["py_spy"] = profile(server, sc, args.py_spy, args.profile_seconds)
        finally:
            server.stop()
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, --seconds {args.seconds}")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
