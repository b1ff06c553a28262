"""Where the serving path spends the CPU: every process of the service under the 32-stream load.

    python -m bench.path_profile [--py-spy /tmp/pyspy/bin/py-spy] [--max-tokens 128] [--json out.json]
    python -m bench.path_profile --streams 1 8 32 128 --prompt-tokens 64 768 --max-tokens 64

Starts the service as bench.vllm_peer does (serve_config.cpu.yaml's application, HAProxy in front, the same
random GPT-2 on the demo vocabulary), runs 32 streamed `/v1/completions` clients (token-id prompts, greedy,
`ignore_eos`), and reads every process's CPU time from /proc before and after: CPU milliseconds per 1,000
generated tokens per process (HAProxy, the Serve proxy and controller, the Ingress replica, the chat replica,
its engine process, the decision replica, Ray's own), and the share of the machine each took. With --py-spy
(py-spy is on the registry: `pip install --target /tmp/pyspy py-spy`), each Python process of the path is
sampled during a second load and its hottest functions printed (at the last stream count). Several
`--streams` and `--prompt-tokens` (prompts of exactly that many tokens instead of 16-96) run one after
another on the same service, each with its own table, then a summary of the path's CPU per token.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from bench.vllm_peer import app_overrides, build_checkpoints, load, prompts, start_ours

TICK = os.sysconf("SC_CLK_TCK")


def session_pids(sid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
                out.append(int(entry))
    return out


def name_of(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"
    for key, label in (("haproxy", "HAProxy"), ("ServeReplica:startlux:Ingress", "Ingress replica"),
                       ("ServeReplica:startlux:ChatModel", "chat replica"),
                       ("ServeReplica:startlux:DecisionModel", "decision replica"),
                       ("engine_process", "chat engine process"), ("core.decision", "decision process"),
                       ("ProxyActor", "Serve proxy"),
                       ("ServeController", "Serve controller"), ("raylet", "raylet"), ("gcs_server", "GCS"),
                       ("serve run", "serve run"), ("dashboard", "Ray dashboard"), ("log_monitor", "Ray log monitor"),
                       ("-m bench.", "load generator")):
        if key in cmd:
            return label
    script = next((w for w in cmd.split() if w.endswith(".py")), None)      # Ray's Python helpers by script name
    return Path(script).name if script else cmd[:40]


def cpu_ticks(pids: list[int]) -> dict[int, int]:
    out = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = int(fields[11]) + int(fields[12])        # utime + stime
    return out


def hottest(py_spy: str, pid: int, seconds: int, top: int = 15,
            gil: bool = False) -> tuple[float, list[tuple[str, float, float]]]:
    """py-spy's samples of `pid`'s threads (idle ones left out) for `seconds` -> (samples per second,
    the functions with the most samples: (function, share as the innermost Python frame, share anywhere on the
    stack)). `gil`: only the thread holding the GIL is sampled (where the process's Python time goes)."""
    with tempfile.NamedTemporaryFile(suffix=".txt") as f:
        subprocess.run([py_spy, "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "100",
                        *(["--gil"] if gil else []), "--nonblocking", "--format", "raw", "--output", f.name],
                       capture_output=True, timeout=seconds + 60)
        own, anywhere, total = collections.Counter(), collections.Counter(), 0
        for line in Path(f.name).read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            if not n.isdigit():
                continue
            frames = [fr.split(" (")[0] + " " + fr.rsplit("/", 1)[-1].rstrip(")") for fr in stack.split(";")]
            total += int(n)
            own[frames[-1]] += int(n)
            for fr in set(frames):
                anywhere[fr] += int(n)
    if not total:
        return 0.0, []
    return total / seconds, [(k, v / total, anywhere[k] / total) for k, v in own.most_common(top)]


def cpu_table(before: dict[int, int], after: dict[int, int], wall: float, units: float, label: str) -> dict:
    """Print and return each process's CPU seconds between two cpu_ticks readings (summed by name), with its
    CPU milliseconds per unit of work (`units` of them in the window) and its share of the machine."""
    per = collections.defaultdict(float)
    for pid, t in after.items():
        per[name_of(pid)] += (t - before.get(pid, t)) / TICK
    print(f"{'process':26}{'CPU s':>8}{label:>18}{'of the machine':>16}")
    rows = dict(sorted(per.items(), key=lambda kv: -kv[1]))
    for name, cpu in rows.items():
        print(f"{name:26}{cpu:8.2f}{1000 * cpu / units:18.2f}{100 * cpu / (wall * os.cpu_count()):15.1f}%")
    return rows


def profile_processes(py_spy: str, pids: list[int], names: tuple[str, ...], loaded, seconds: int, top: int = 15,
                      gil: bool = False, label: str = "") -> dict:
    """py-spy's hottest functions of the first process of each of `names` among `pids`, each sampled for
    `seconds` while a fresh load runs: `loaded()` returns the load as a thread not yet started (`top`, `gil`:
    as hottest's; `label` starts each heading)."""
    by_name: dict[str, int] = {}
    for pid in pids:
        by_name.setdefault(name_of(pid), pid)
    out = {}
    for name in (n for n in names if n in by_name):
        loader = loaded()
        loader.start()
        time.sleep(3)
        rate, hot = hottest(py_spy, by_name[name], seconds, top=top, gil=gil)
        loader.join()
        print(f"== {label}{name} (pid {by_name[name]}): {rate:.0f} busy samples/s at 100/s per thread; "
              f"innermost frame, and anywhere on the stack")
        for frame, share, inclusive in hot:
            print(f"{100 * share:6.1f}% {100 * inclusive:6.1f}%  {frame}")
        out[name] = {"samples_per_s": rate, "top": hot}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--py-spy")
    p.add_argument("--streams", type=int, nargs="+", default=[32])
    p.add_argument("--prompt-tokens", type=int, nargs="*", default=[],
                   help="prompts of exactly this many tokens (default: 16-96); several run in turn")
    p.add_argument("--per-client", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seconds", type=int, default=20, help="py-spy sampling time per process")
    p.add_argument("--gil", action="store_true", help="py-spy samples only the thread holding the GIL")
    p.add_argument("--top", type=int, default=15, help="py-spy: how many functions to print per process")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an application argument over serve_config.cpu.yaml's (YAML value), e.g. chat_stream_interval=8")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="added to the service's environment")
    p.add_argument("--json")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="path-profile-"))
    ours, _, vocab, bos = build_checkpoints(work)
    def prompt_set(n: int, length: int | None) -> list[list[int]]:
        if length is None:
            return prompts(n, min(vocab, bos), bos)
        rng = random.Random(length)
        return [[bos] + [rng.randrange(min(vocab, bos)) for _ in range(length - 1)] for _ in range(n)]

    overrides = app_overrides(args.set)
    server = start_ours(ours, work, overrides, dict(kv.split("=", 1) for kv in args.env))
    result, summary = {"runs": []}, []
    path = ("Ingress replica", "chat replica", "HAProxy", "chat engine process")
    try:
        server.wait_ready()
        asyncio.run(load(server.url, None, 4, 1, 8, prompt_set(4, None)))
        pids = session_pids(server.proc.pid)
        for length in args.prompt_tokens or [None]:
            for streams in args.streams:
                ids = prompt_set(streams * args.per_client, length)
                before, t0 = cpu_ticks(pids), time.perf_counter()
                run = asyncio.run(load(server.url, None, streams, args.per_client, args.max_tokens, ids))
                after, wall = cpu_ticks(pids), time.perf_counter() - t0
                shape = f"{length}-token prompts" if length else "16-96-token prompts"
                print(f"{streams} streams x {args.max_tokens} tokens, {shape}: {run['tokens_per_s']:.1f} tokens/s, "
                      f"TTFT p50 {run['ttft_p50_ms']:.1f} ms, {wall:.1f} s, {os.cpu_count()} cores")
                rows = cpu_table(before, after, wall, run["tokens"] / 1000, "ms / 1k tokens")
                per_token = {name: 1e6 * rows.get(name, 0.0) / run["tokens"] for name in path}
                summary.append((streams, length, run["tokens_per_s"], per_token))
                result["runs"].append({"streams": streams, "prompt_tokens": length, "run": run, "wall_s": wall,
                                       "cpu_s": rows, "us_per_token": per_token})
        print("\nus of CPU per generated token | " + " | ".join(path) + " | path (all but the engine)")
        for streams, length, rate, per_token in summary:
            serving = sum(v for k, v in per_token.items() if k != "chat engine process")
            print(f"{streams:4} streams, {length or '16-96'} prompt tokens, {rate:7.1f} tokens/s | "
                  + " | ".join(f"{per_token[k]:6.1f}" for k in path) + f" | {serving:6.1f}")
        if args.py_spy:
            streams, ids = args.streams[-1], prompt_set(args.streams[-1] * args.per_client, None)

            def loaded():    # the load on a thread of its own, so that it runs while py-spy samples
                per_client = max(1, int(3 * args.seconds * 800 / args.max_tokens) // streams)
                return threading.Thread(target=asyncio.run, daemon=True, args=(load(
                    server.url, None, streams, per_client, args.max_tokens, ids),))
            result["py_spy"] = profile_processes(args.py_spy, pids, ("Ingress replica", "chat replica",
                                                 "chat engine process", "Serve proxy"), loaded, args.seconds,
                                                 top=args.top, gil=args.gil)
    finally:
        server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
