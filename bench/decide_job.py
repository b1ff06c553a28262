"""`startlux decide` on Ray Data against the same requests through the HTTP service.

    python -m bench.decide_job [--rounds 2] [--requests 768] [--clients 32] [--actors 1] [--json out.json]

The cheap workload (bench.decision's: small states, 3 questions, half the states repeated) as a JSON Lines
file; each round runs `startlux decide` over it (a fresh local Ray, the shipped serve_config.cpu.yaml's
decision settings, `--actors` actors) and then sends the same bodies to the service (serve_config.cpu.yaml,
HAProxy in front) from `--clients` closed-loop clients, alternating. Prints rows/s of each: for the job, from
its start to its last row written (Ray's start and the model's load excluded by the job's own clock), and its
wall time with them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.decision import cheap_workload
from bench.systemone import load
from bench.vllm_peer import ROOT, build_checkpoints, start_ours


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=768)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--actors", type=int, default=1)
    p.add_argument("--json")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="decide-job-"))
    chat, *_ = build_checkpoints(work)
    rows = []
    for r in range(a.rounds):
        reqs = cheap_workload(a.requests, 4000 + r)
        src = work / f"in{r}.jsonl"
        src.write_text("".join(json.dumps(x) + "\n" for x in reqs))
        t0 = time.perf_counter()
        out = subprocess.run([str(Path(sys.executable).parent / "startlux"), "decide", str(src), str(work / "out.jsonl"),
                              str(ROOT / "serve_config.cpu.yaml"), "--actors", str(a.actors)],
                             capture_output=True, text=True, timeout=1800, cwd=work)
        wall = time.perf_counter() - t0
        if out.returncode:
            raise RuntimeError(out.stderr[-3000:])
        job = json.loads(out.stdout.strip().splitlines()[-1])
        server = start_ours(chat, work)
        try:
            server.wait_ready()
            asyncio.run(load(server.url, cheap_workload(8, 99), 4))
            service = asyncio.run(load(server.url, reqs, a.clients))
        finally:
            server.stop()
        row = {"round": r + 1, "job_rows_per_s": job["rows_per_s"], "job_wall_s": wall,
               "job_rows_per_s_with_start": len(reqs) / wall, "service_rows_per_s": len(reqs) / service["seconds"],
               "service_p50_ms": service["p50_ms"]}
        rows.append(row)
        print(f"round {r + 1}: startlux decide {job['rows_per_s']:.1f} rows/s ({len(reqs) / wall:.1f} with Ray's start "
              f"and the model's load, {wall:.1f} s); the service, {a.clients} clients: "
              f"{row['service_rows_per_s']:.1f} requests/s", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
