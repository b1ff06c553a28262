"""Where a refusal's CPU goes: a service that refuses every generation, and a storm of clients resending at once.

    python -m bench.refusals [--clients 128] [--seconds 10] [--client plain|lean] [--no-stream]
                             [--set KEY=VALUE ...] [--env NAME=VALUE ...] [--json out.json]

Starts serve_config.cpu.yaml's service (HAProxy in front, as the README runs it) with the Ingress's admission at
`max_chat_inflight: 0, max_chat_waiting: 0` and `refusal_delay_s: 0`, so every chat request is refused with
503 and nothing is generated (--set overrides any of these), and runs bench.overload's clients against it:
each resends at once on its 503, for --seconds. Reported: refusals per second and each process's CPU
microseconds per refusal (HAProxy, the Ingress replica, Serve's processes, this load generator), from /proc
and getrusage.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from bench.overload import CpuMark, run
from bench.path_profile import session_pids
from bench.vllm_peer import ROOT, app_overrides, start_ours

REFUSE_ALL = {"max_chat_inflight": 0, "max_chat_waiting": 0, "refusal_delay_s": 0}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--clients", type=int, default=128)
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--client", choices=("plain", "lean"), default="plain")
    p.add_argument("--no-stream", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--json")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="refusals-"))
    server = start_ours(ROOT / "models" / "demo-chat", work, REFUSE_ALL | app_overrides(args.set),
                        dict(kv.split("=", 1) for kv in args.env))
    try:
        server.wait_ready()
        asyncio.run(run(server.url, 8, 2, 8, "immediate", args.client, not args.no_stream))     # warm up
        mark = CpuMark(session_pids(server.proc.pid))
        out, wall = asyncio.run(run(server.url, args.clients, args.seconds, 8, "immediate", args.client,
                                    not args.no_stream, mark.start))
        cpu = mark.seconds()
    finally:
        server.stop()
    refused = out["rejected"]
    print(f"{args.clients} {args.client} clients, {'whole' if args.no_stream else 'streamed'}: {refused} refusals "
          f"in {wall:.1f} s ({refused / wall:.0f}/s), {len(out['done'])} answered")
    print(f"{'process':26}{'CPU s':>8}{'us / refusal':>14}")
    for name, s in sorted(cpu.items(), key=lambda kv: -kv[1]):
        if s > 0.005:
            print(f"{name:26}{s:8.2f}{1e6 * s / max(1, refused):14.0f}")
    print(f"{'all':26}{sum(cpu.values()):8.2f}{1e6 * sum(cpu.values()) / max(1, refused):14.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"clients": args.clients, "client": args.client,
                                               "stream": not args.no_stream, "seconds": wall, "refused": refused,
                                               "settings": REFUSE_ALL | app_overrides(args.set), "env": args.env,
                                               "cpu_s": cpu}, indent=1))


if __name__ == "__main__":
    main()
