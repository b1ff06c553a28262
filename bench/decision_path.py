"""Decisions through the service against `decide_batch` offline, on the same requests.

    python -m bench.decision_path [--rounds 2] [--clients 32] [--set KEY=VALUE ...] [--env NAME=VALUE ...] [--profile]
                                  [--py-spy /tmp/pyspy/bin/py-spy] [--json out.json]

Two workloads: `cheap` (small states of a few dozen tokens, 3 questions each (choice, noul, score), and about
half of the states sent before: the requests whose cost is mostly the path's) and `client` (bench.decision's
client-shaped workload: states of 200-2,000 tokens, 1-8 questions, a quarter repeated). Each round starts the
service as serve_config.cpu.yaml does (HAProxy in front; `--set` overrides an application argument), sends
each workload from `--clients` closed-loop clients, stops it, then runs the same requests offline through a
fresh scorer built with the service's decision settings, in batches of the deployment's batch size, with the
machine to itself. A round's requests are new to both (seed per round), so both start with an empty prefix
cache. Prints questions/s of each and the service's share of offline. `--profile`: each process's CPU per
request (from /proc) over the first round's service run of each workload; `--py-spy`: then the hottest
functions of the Ingress, the decision replica and its scorer process under a further cheap load (GIL
samples).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from core.decision.config import H200_QUESTION_S
from bench.decision import cheap_workload, client_workload, count_questions
from bench.sse import closed_loop as raw_load
from bench.path_profile import cpu_table, cpu_ticks, profile_processes, session_pids
from bench.vllm_peer import ROOT, app_overrides, build_checkpoints, start_ours


OFFLINE = """
import json, sys, time
import torch
from deployments.settings import AppArgs, BatchSettings
from core.decision import StartLuxDecision
args, reqs = json.loads(sys.argv[1]), json.loads(open(sys.argv[2]).read())
d = AppArgs.model_validate(args).decision
if d.torch_threads:
    torch.set_num_threads(d.torch_threads)
scorer = StartLuxDecision(d.checkpoint, d.scorer, device=d.device)
batch = BatchSettings().max_batch_size
scorer.decide_batch([("a warm-up state of no request", reqs[0]["questions"])] * 2)
t0 = time.perf_counter()
for i in range(0, len(reqs), batch):
    scorer.decide_batch([(r["state"], r["questions"]) for r in reqs[i:i + batch]])
print("RESULT", json.dumps({"seconds": time.perf_counter() - t0}))
"""


def offline_seconds(app_args: dict, reqs: list[dict], work: Path, env: dict | None = None) -> float:
    path = work / "reqs.json"
    path.write_text(json.dumps(reqs))
    out = subprocess.run([sys.executable, "-c", OFFLINE, json.dumps(app_args), str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=1800, env={**os.environ, **(env or {})})
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])["seconds"]
    raise RuntimeError(out.stderr[-3000:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--cheap-per-client", type=int, default=24)
    p.add_argument("--client-per-client", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an application argument over serve_config.cpu.yaml's (YAML value)")
    p.add_argument("--offline-threads", type=int, nargs="*", default=[1, 2],
                   help="torch thread counts to run offline besides the service's own")
    p.add_argument("--profile", action="store_true", help="CPU per request of every process (first round)")
    p.add_argument("--py-spy", help="py-spy's path: profile the decision path's Python processes (first round)")
    p.add_argument("--synthetic", action="store_true",
                   help="the path at GPU rates: the service with the synthetic scorer, no offline side")
    p.add_argument("--question-s", type=float, nargs="*", default=[H200_QUESTION_S, 0.0],
                   help="--synthetic: the synthetic scorer's seconds per question, each its own service")
    p.add_argument("--deployment", action="append", default=[], metavar="NAME=JSON",
                   help="--synthetic: options of a deployment over the config's, e.g. "
                        "'DecisionModel={\"logging_config\": {\"enable_access_log\": false}}'")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="added to the environment of the service and of the offline scorer (e.g. OMP_WAIT_POLICY)")
    p.add_argument("--json")
    args = p.parse_args()
    if args.synthetic:
        return synthetic_path(args)
    from transformers import AutoTokenizer

    overrides = app_overrides(args.set)
    env = dict(kv.split("=", 1) for kv in args.env)
    app_args = {**yaml.safe_load((ROOT / "serve_config.cpu.yaml").read_text())["applications"][0]["args"],
                **overrides}
    tok = AutoTokenizer.from_pretrained(str(ROOT / decision_checkpoint(app_args)))
    work = Path(tempfile.mkdtemp(prefix="decision-path-"))
    chat, *_ = build_checkpoints(work)
    rows = []
    for r in range(args.rounds):
        workloads = {"cheap": cheap_workload(args.clients * args.cheap_per_client, 1000 + r),
                     "client": client_workload(args.clients * args.client_per_client, 2000 + r,
                                               count=lambda t: len(tok.encode(t, add_special_tokens=False)))}
        server = start_ours(chat, work, overrides, env)
        service = {}
        try:
            server.wait_ready()
            warm = cheap_workload(8, 99)
            asyncio.run(raw_load(server.url, warm, 4))
            pids = session_pids(server.proc.pid) + [os.getpid()]     # the load generator's own CPU too
            for name, reqs in workloads.items():
                before, t0 = cpu_ticks(pids), time.perf_counter()
                service[name] = asyncio.run(raw_load(server.url, reqs, args.clients))
                service[name]["questions_per_s"] = count_questions(reqs) / service[name]["seconds"]
                if r == 0 and (args.profile or args.py_spy):
                    print(f"round 1 {name}: CPU per request")
                    rows.append({"round": 1, "workload": name, "cpu_s": cpu_table(
                        before, cpu_ticks(pids), time.perf_counter() - t0, len(reqs), "ms / request")})
            if r == 0 and args.py_spy:
                more = cheap_workload(args.clients * args.cheap_per_client, 3000)
                profile_processes(args.py_spy, pids, ("Ingress replica", "decision replica", "decision process"),
                                  lambda: threading.Thread(target=asyncio.run, daemon=True,
                                                           args=(raw_load(server.url, more, args.clients),)), 5)
        finally:
            server.stop()
        own = app_args.get("decision_torch_threads")
        for name, reqs in workloads.items():
            s = service[name]
            offline = {t: count_questions(reqs) / offline_seconds({**app_args, "decision_torch_threads": t}, reqs,
                                                                  work, env)
                       for t in sorted({own, *args.offline_threads} - {None})}
            rows.append({"round": r + 1, "workload": name, "service_threads": own, "service_qps": s["questions_per_s"],
                         "p50_ms": s["p50_ms"], "offline_qps_by_threads": offline})
            shares = ", ".join(f"{t} thread{'s' * (t > 1)} {q:.1f} ({100 * s['questions_per_s'] / q:.0f}%)"
                               for t, q in offline.items())
            print(f"round {r + 1} {name:6}: service ({own} threads) {s['questions_per_s']:6.1f} questions/s "
                  f"(p50 {s['p50_ms']:.0f} ms); decide_batch offline: {shares}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=2))


def synthetic_path(args) -> None:
    """The decision path at a GPU's rate: for each --question-s, the service with the synthetic scorer, the cheap
    workload from one client (latency the path adds to a lone request) and from --clients (decisions per second
    and every process's CPU per request), each round alternating the rates."""
    overrides = app_overrides(args.set)
    batch = 16
    work = Path(tempfile.mkdtemp(prefix="decision-path-"))
    chat, *_ = build_checkpoints(work)
    rows = []
    for r in range(args.rounds):
        for q in args.question_s:
            options = {name: json.loads(value) for name, value in (d.split("=", 1) for d in args.deployment)}
            server = start_ours(chat, work, {**overrides, "decision_scorer": "synthetic",
                                             "decision_synthetic_question_s": q}, deployments=options)
            try:
                server.wait_ready()
                asyncio.run(raw_load(server.url, cheap_workload(16, 99), 4))
                lone = asyncio.run(raw_load(server.url, cheap_workload(200, 500 + r), 1))
                pids = session_pids(server.proc.pid) + [os.getpid()]     # the load generator's own CPU too
                reqs = cheap_workload(args.clients * args.cheap_per_client, 1000 + r)
                before, t0 = cpu_ticks(pids), time.perf_counter()
                many = asyncio.run(raw_load(server.url, reqs, args.clients))
                many["questions_per_s"] = count_questions(reqs) / many["seconds"]
                wall = time.perf_counter() - t0
                print(f"round {r + 1}, {q * 1e6:.0f} us per question: CPU per request, {args.clients} clients")
                cpu = cpu_table(before, cpu_ticks(pids), wall, len(reqs), "ms / request")
                n = args.clients * args.cheap_per_client
                before, t0 = cpu_ticks(pids), time.perf_counter()
                floor_s = asyncio.run(raw_load(server.url, [[]] * n, args.clients, expect=400))["seconds"]
                print(f"round {r + 1}: the HTTP path alone (refused bodies, no model call): {n / floor_s:.0f} "
                      f"requests/s; CPU per request")
                floor = cpu_table(before, cpu_ticks(pids), time.perf_counter() - t0, n, "ms / request")
                if args.py_spy and r == 0:
                    more = cheap_workload(4000, 3000)      # enough to outlast a profile
                    profile_processes(args.py_spy, pids, ("Ingress replica", "decision replica"),
                                      lambda: threading.Thread(target=asyncio.run, daemon=True,
                                                               args=(raw_load(server.url, more, args.clients),)), 6,
                                      top=40, gil=True)
            finally:
                server.stop()
            device_qps = 1 / q if q else float("inf")
            row = {"round": r + 1, "question_s": q, "lone_p50_ms": lone["p50_ms"], "lone_p99_ms": lone["p99_ms"],
                   "lone_device_ms": 3e3 * q, "qps": many["questions_per_s"], "requests_per_s": len(reqs) / wall,
                   "p50_ms": many["p50_ms"], "p99_ms": many["p99_ms"], "device_qps_at_batch_16": device_qps,
                   "cpu_ms_per_request": {k: 1e3 * v / len(reqs) for k, v in cpu.items()},
                   "refused_per_s": n / floor_s, "refused_cpu_ms_per_request": {k: 1e3 * v / n for k, v in floor.items()}}
            rows.append(row)
            print(f"round {r + 1}, {q * 1e6:.0f} us/question: one client p50 {lone['p50_ms']:.2f} ms, p99 "
                  f"{lone['p99_ms']:.2f} ms (the scorer's own {3e3 * q:.2f} ms); {args.clients} clients "
                  f"{many['questions_per_s']:.0f} questions/s ({len(reqs) / wall:.0f} requests/s; the device alone "
                  f"{device_qps:.0f} at any batch), p50 {many['p50_ms']:.1f} ms, p99 {many['p99_ms']:.1f} ms",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "batch": batch, "rows": rows},
                                              indent=2))


def decision_checkpoint(app_args: dict) -> str:
    from deployments.settings import AppArgs

    return AppArgs.model_validate(app_args).decision.checkpoint


if __name__ == "__main__":
    main()
