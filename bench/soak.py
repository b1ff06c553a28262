"""Soak: an hour of mixed traffic at a fraction of saturation, and whether anything grows that should not.

    python -m bench.soak [--minutes 60] [--sample-s 60] [--load 0.6] [--calibrate-s 40] [--rate OPS]
                         [--warmup 0.25] [--warm-decisions 0] [--trace-s 0] [--json out.json]

Starts serve_config.cpu.yaml's service on the demo models as the README does (HAProxy through the launcher, in
a session of its own, stopped by its group id), then:

0. With --warm-decisions N: N decisions of the mix's kind, sent by 16 closed-loop clients as fast as they are
   answered. The decision process's memory settles only after about 20,000 decisions (its 256 MB prefix cache
   fills after ~4,000, the tokenizer's word cache after ~10,000 fresh states, the allocator's pool of block sizes
   by ~20,000: bench/README.md), which the mix at 60% load reaches only after about 100 minutes; this phase
   gets there first, so that an hour of samples shows the settled service.
1. Calibration (unless --rate): closed-loop clients send the mix below as fast as it is answered for
   --calibrate-s; the operations per second they complete is saturation.
2. The soak: operations arrive at random (Poisson) at --load x saturation for --minutes, each a fresh
   asyncio task, so a slow answer does not slow the arrivals:
   - `chat` (40%): a streamed chat question (32 tokens at most), read to its `[DONE]`;
   - `completion` (15%): a whole /v1/completions response (16 tokens);
   - `decision` (25%): /v1/systemone, half of them on one of 8 recurring states (prefix-cache hits);
   - `disconnect` (12%): a streamed chat of 200 tokens (`ignore_eos`) that the client drops after 3 chunks;
   - `bad` (8%): one of four bad requests (no messages, broken JSON, an unknown model, an unknown decision
     question type), each with the status it must get.
3. Every --sample-s: each process of the service's session (grouped by what it is: HAProxy, the replicas, the
   chat engine process, Ray's own) is read from /proc (resident memory, open file descriptors), and
   /debug/stats gives the chat engine's rows in use, its prefix cache (rows, tokens), the decision prefix
   cache's bytes and the Ingress's admission.

Reported: per process group and per counter, the value after warm-up (the first --warmup share of the samples
is left out), at the end, and the least-squares slope per hour over the samples after warm-up; operations sent,
answered as they should be, and every other outcome by kind (an error is any answer but the expected one: a
503, a 500, a stream that ends without `[DONE]`, a client error). After the load, the service must go idle:
no rows in use but the prefix cache's, nothing in flight or waiting in the Ingress, and the same processes as
at the start; each process group's memory and descriptors idle before and after the soak are in the JSON.
tests/test_operations.py runs two minutes of this at a fixed rate on the README's service and asserts only
what is not timing.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import random
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.http import PROMPTS
from bench.path_profile import name_of, session_pids
from bench.vllm_peer import ROOT, start_ours
from core.decision.memory import resident_kb

MIX = {"chat": 0.40, "completion": 0.15, "decision": 0.25, "disconnect": 0.12, "bad": 0.08}
BAD = [  # (path, body: dict or raw text, the status it must get)
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", '{"messages": [', 400),
    ("/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("/v1/systemone", {"state": "s", "questions": {"q": {"type": "guess", "instructions": "?"}}}, 400),
]


@dataclass
class Outcomes:
    sent: collections.Counter = field(default_factory=collections.Counter)
    ok: collections.Counter = field(default_factory=collections.Counter)
    errors: collections.Counter = field(default_factory=collections.Counter)   # (kind, what) -> count
    error_times: list = field(default_factory=list)   # (seconds since the start, kind, what), the first 200
    t0: float = field(default_factory=time.monotonic)

    def error_counts(self) -> dict[str, int]:
        return {f"{kind} / {what}": n for (kind, what), n in self.errors.items()}

    def fail(self, kind: str, what: str) -> None:
        self.errors[(kind, what)] += 1
        if len(self.error_times) < 200:
            self.error_times.append((round(time.monotonic() - self.t0, 1), kind, what))


def decision_body(rng: random.Random) -> dict:
    state = (f"recurring state {rng.randrange(8)}: " + "the office opens at nine and closes at five. " * 20
             if rng.random() < 0.5 else f"a fresh state {rng.random()}: the shop sells {rng.randrange(1000)} pears.")
    return {"state": state, "questions": {
        "open": {"type": "noul", "instructions": "Is it open at ten?"},
        "fruit": {"type": "choice", "instructions": "Which option is a fruit?",
                  "criteria": {"a": "tiger", "b": "plum", "c": "drill"}}}}


async def one(client: httpx.AsyncClient, kind: str, rng: random.Random, out: Outcomes) -> None:
    """One operation of `kind`; its outcome in `out`."""
    out.sent[kind] += 1
    try:
        if kind in ("chat", "disconnect"):
            body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "stream": True,
                    "max_tokens": 32 if kind == "chat" else 200, "ignore_eos": kind == "disconnect"}
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    return out.fail(kind, f"status {r.status_code}")
                chunks, done = 0, False
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        chunks += 1
                        done = line == "data: [DONE]"
                        if '"error"' in line and not done:
                            return out.fail(kind, "error event")
                        if kind == "disconnect" and chunks == 3:
                            break                          # the client goes away mid-stream
                if kind == "chat" and not done:
                    return out.fail(kind, "stream ended without [DONE]")
        elif kind == "completion":
            r = await client.post("/v1/completions", json={"prompt": rng.choice(PROMPTS), "max_tokens": 16})
            if r.status_code != 200 or r.json()["usage"]["completion_tokens"] < 1:
                return out.fail(kind, f"status {r.status_code}")
        elif kind == "decision":
            r = await client.post("/v1/systemone", json=decision_body(rng))
            if r.status_code != 200 or set(r.json()["answers"]) != {"open", "fruit"}:
                return out.fail(kind, f"status {r.status_code}")
        else:
            path, body, status = rng.choice(BAD)
            r = await (client.post(path, content=body, headers={"content-type": "application/json"})
                       if isinstance(body, str) else client.post(path, json=body))
            if r.status_code != status or "error" not in r.json():
                return out.fail(kind, f"status {r.status_code}, not {status}")
        out.ok[kind] += 1
    except (httpx.HTTPError, ValueError, KeyError) as e:
        out.fail(kind, type(e).__name__)


def kinds(rng: random.Random):
    names, weights = list(MIX), list(MIX.values())
    while True:
        yield rng.choices(names, weights)[0]


async def calibrate(url: str, seconds: float, clients: int = 40) -> float:
    """Operations per second the mix completes with `clients` closed-loop clients (saturation)."""
    out, deadline = Outcomes(), time.monotonic() + seconds

    async def loop(i):
        rng, stream = random.Random(i), kinds(random.Random(100 + i))
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            while time.monotonic() < deadline:
                await one(client, next(stream), rng, out)

    t0 = time.monotonic()
    await asyncio.gather(*(loop(i) for i in range(clients)))
    return sum(out.sent.values()) / (time.monotonic() - t0)


async def warm_decisions(url: str, n: int, clients: int = 16) -> Outcomes:
    """`n` decisions like the mix's, sent by `clients` closed-loop clients as fast as they are answered."""
    out, left = Outcomes(), iter(range(n))

    async def loop(i):
        rng = random.Random(1000 + i)
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            for _ in left:
                await one(client, "decision", rng, out)

    await asyncio.gather(*(loop(i) for i in range(clients)))
    return out


def processes(sid: int) -> dict[int, str]:
    return {pid: name_of(pid) for pid in session_pids(sid)}


def sample(url: str, sid: int, t: float) -> dict:
    """Resident memory (MB) and open descriptors per process group of session `sid`, and the service's counters."""
    groups: dict[str, dict] = collections.defaultdict(lambda: {"rss_mb": 0.0, "fds": 0, "n": 0})
    for pid, name in processes(sid).items():
        try:
            rss = resident_kb(pid) / 1024
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue                                       # gone between the listing and the read
        g = groups[name]
        g["rss_mb"] += rss
        g["fds"] += fds
        g["n"] += 1
    stats = httpx.get(url + "/debug/stats", timeout=30).json()
    chat, decision, ingress = stats["chat"], stats["decision"], stats["ingress"]
    counters = {"chat rows used": chat["rows_used"], "chat running": chat["running"],
                "chat prefix-cache blocks": chat["prefix_cache"]["cached_blocks"],
                "chat prefix-cache tokens": chat["prefix_cache"]["cached_tokens"],
                "decision prefix-cache MB": decision["prefix_cache"]["bytes"] / 2 ** 20,
                "decision prefix-cache entries": decision["prefix_cache"]["entries"],
                "decision memory returns": decision["memory"].get("returns", 0),
                "decision heap in use MB": decision["memory"].get("in_use", 0),
                "ingress in flight": ingress["chat_in_flight"], "ingress waiting": ingress["chat_waiting"]}
    return {"t": t, "groups": dict(groups), "counters": counters}


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (x, y) points (0 for fewer than two distinct x)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per hour."""
    return 3600 * slope(points)


def series(samples: list[dict]) -> dict[str, list[tuple[float, float]]]:
    out = collections.defaultdict(list)
    for s in samples:
        for name, g in s["groups"].items():
            out[f"{name} RSS MB"].append((s["t"], g["rss_mb"]))
            out[f"{name} fds"].append((s["t"], g["fds"]))
        for name, v in s["counters"].items():
            out[name].append((s["t"], v))
    return dict(out)


def summary(samples: list[dict], warmup: float) -> list[dict]:
    """Per series: after warm-up, at the end, the slope per hour after warm-up."""
    start = samples[min(int(len(samples) * warmup), len(samples) - 1)]["t"]
    rows = []
    for name, points in sorted(series(samples).items()):
        kept = [p for p in points if p[0] >= start]
        if kept:
            rows.append({"series": name, "after_warmup": kept[0][1], "end": kept[-1][1],
                         "slope_per_hour": slope_per_hour(kept)})
    return rows


async def arrivals(url: str, rate: float, seconds: float, sample_every: float, on_sample, seed: int = 0) -> Outcomes:
    """Poisson arrivals of the mix at `rate` per second for `seconds`; `on_sample(t)` every `sample_every` s
    (on a thread, so /proc and /debug/stats reads do not hold up the arrivals); waits for every operation."""
    out, rng, stream = Outcomes(), random.Random(seed), kinds(random.Random(seed + 1))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        tasks, samplers, t0 = set(), [], time.monotonic()
        next_arrival, next_sample = t0, t0
        while (now := time.monotonic()) < t0 + seconds:
            if now >= next_sample:
                next_sample += sample_every
                samplers.append(asyncio.create_task(asyncio.to_thread(on_sample, now - t0)))
            if now >= next_arrival:
                task = asyncio.create_task(one(client, next(stream), random.Random(rng.random()), out))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                next_arrival += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, min(next_arrival, next_sample) - time.monotonic()))
        await asyncio.gather(*tasks, *samplers)
    return out


def wait_idle(url: str, sid: int, timeout: float = 60) -> dict:
    """The service's counters once nothing runs (the chat engine reports when it goes idle)."""
    deadline = time.monotonic() + timeout
    while True:
        s = sample(url, sid, 0.0)["counters"]
        idle = s["chat running"] == 0 and s["ingress in flight"] == 0 and s["ingress waiting"] == 0
        if idle or time.monotonic() > deadline:
            return s
        time.sleep(0.5)


class Trace(threading.Thread):
    """Every `every` s until stopped: the Ingress's admission, the chat engine's streams and the decision
    batches from /debug/stats, with how long the call took (a stalled Ingress shows there): (t, row) in `rows`."""

    def __init__(self, url: str, every: float, t0: float):
        super().__init__(daemon=True)
        self.url, self.every, self.t0, self.rows, self.done = url, every, t0, [], threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.done.wait(self.every):
                t = time.monotonic()
                try:
                    s = client.get(self.url + "/debug/stats").json()
                except (httpx.HTTPError, ValueError):
                    self.rows.append((round(t - self.t0, 1), None))
                    continue
                self.rows.append((round(t - self.t0, 1), {
                    "stats_s": round(time.monotonic() - t, 3), "in_flight": s["ingress"]["chat_in_flight"],
                    "waiting": s["ingress"]["chat_waiting"], "refused": s["ingress"].get("chat_refused"),
                    "running": s["chat"]["running"], "decision_batches": s["decision"]["batches"]}))

    def around(self, t: float, before: float = 15, after: float = 3) -> list:
        return [r for r in self.rows if t - before <= r[0] <= t + after]


def soak(url: str, sid: int, minutes: float, sample_s: float, rate: float | None = None, load: float = 0.6,
         calibrate_s: float = 40, warmup: float = 0.25, trace_s: float = 0, warm: int = 0) -> dict:
    """The soak against the running service at `url` whose processes are session `sid`; `rate` None: `load` x
    the saturation a calibration measures. `trace_s`: also read the admission, streams and decision batches
    that often, and report them around each error. `warm`: that many decisions first (step 0 above)."""
    saturation, warmed = None, None
    if warm:
        t0 = time.monotonic()
        w = asyncio.run(warm_decisions(url, warm))
        warmed = {"sent": w.sent["decision"], "ok": w.ok["decision"], "errors": w.error_counts(),
                  "seconds": round(time.monotonic() - t0, 1)}
    if rate is None:
        saturation = asyncio.run(calibrate(url, calibrate_s))
        rate = load * saturation
    wait_idle(url, sid)
    start_procs, before = processes(sid), sample(url, sid, 0.0)
    samples: list[dict] = []
    trace = Trace(url, trace_s, time.monotonic()) if trace_s else None
    if trace:
        trace.start()
    try:
        out = asyncio.run(arrivals(url, rate, minutes * 60, sample_s,
                                   lambda t: samples.append(sample(url, sid, t))))
    finally:
        if trace:
            trace.done.set()
            trace.join()
    samples.append(sample(url, sid, minutes * 60))
    samples.sort(key=lambda s: s["t"])
    idle = wait_idle(url, sid)
    end_procs, after = processes(sid), sample(url, sid, 0.0)
    return {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "minutes": minutes, "rate_per_s": rate, "saturation_per_s": saturation,
            "load": load if saturation else None, "warm_decisions": warmed, "sent": dict(out.sent), "ok": dict(out.ok),
            "errors": out.error_counts(), "error_times": out.error_times,
            "idle_after": idle, "idle_groups": {"before": before["groups"], "after": after["groups"]},
            "summary": summary(samples, warmup), "samples": samples,
            "processes_gone": sorted(set(start_procs.values()) - set(end_procs.values())),
            "processes_new": sorted(set(end_procs.values()) - set(start_procs.values())),
            "process_count": [len(start_procs), len(end_procs)],
            "trace_around_errors": [{"error": e, "trace": trace.around(e[0])} for e in out.error_times[:20]]
            if trace else None}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--minutes", type=float, default=60)
    p.add_argument("--sample-s", type=float, default=60)
    p.add_argument("--load", type=float, default=0.6, help="share of saturation to send")
    p.add_argument("--calibrate-s", type=float, default=40)
    p.add_argument("--rate", type=float, help="operations per second (skips the calibration)")
    p.add_argument("--warmup", type=float, default=0.25, help="share of the samples left out of the slopes")
    p.add_argument("--warm-decisions", type=int, default=0,
                   help="send this many decisions as fast as they are answered before the calibration and the soak")
    p.add_argument("--trace-s", type=float, default=0,
                   help="read the admission, streams and decision batches this often; shown around each error")
    p.add_argument("--json")
    args = p.parse_args()
    server = start_ours(ROOT / "models" / "demo-chat", Path(tempfile.mkdtemp(prefix="soak-")))
    try:
        server.wait_ready()
        r = soak(server.url, server.proc.pid, args.minutes, args.sample_s, args.rate, args.load, args.calibrate_s,
                 args.warmup, args.trace_s, args.warm_decisions)
    finally:
        server.stop()
    sat = f" ({r['saturation_per_s']:.1f}/s saturation x {r['load']:g})" if r["saturation_per_s"] else ""
    print(f"{r['date']}, {r['machine']}: {r['minutes']:g} min at {r['rate_per_s']:.1f} operations/s{sat}")
    if r["warm_decisions"]:
        print(f"warm-up: {r['warm_decisions']}")
    print(f"sent {sum(r['sent'].values())} ({r['sent']}), answered as they should {sum(r['ok'].values())}")
    when = f" at {r['error_times'][:20]}" if r["errors"] else ""
    print(f"errors: {r['errors'] or 'none'}{when}; processes {r['process_count'][0]} -> {r['process_count'][1]}, "
          f"gone {r['processes_gone']}, new {r['processes_new']}; idle after: {r['idle_after']}")
    print(f"{'series':40}{'after warm-up':>15}{'end':>12}{'slope / hour':>14}")
    for row in r["summary"]:
        print(f"{row['series']:40}{row['after_warmup']:15.1f}{row['end']:12.1f}{row['slope_per_hour']:14.2f}")
    for e in r["trace_around_errors"] or []:
        print(f"around {e['error']}:")
        for t, row in e["trace"]:
            print(f"  {t:8.1f} {row}")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
