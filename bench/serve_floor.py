"""What Ray Serve itself costs per streamed request, beside what the service costs: the floor of #53's path.

    python -m bench.serve_floor [--streams 16] [--requests 640] [--max-tokens 4 64] [--hold 4] [--rounds 2]

Starts, one after the other and in turn, (a) a bare Serve application made the way the service is (a FastAPI
ingress deployment that calls a streaming deployment through a handle and answers server-sent events, both
run by `serve run` with `startlux serve`'s Ray settings: HAProxy in front, Serve's throughput mode, one
replica each) whose streaming deployment yields one message per `--hold` tokens at once, with no model, no
admission, no token channel; and (b) the service as `serve_config.cpu.yaml` starts it (bench.vllm_peer's
random GPT-2, the CPU config, 4 tokens a message here to match). Both get the same closed-loop load
(`--streams` clients, `--requests` streamed `/v1/completions` each of `--max-tokens`, token-id prompts), and
every process's CPU is read from /proc around it: CPU ms per request of the Ingress, the streaming replica and
HAProxy. The bare app's figures are what Serve's routing, its two gRPC hops and FastAPI cost a request with
nothing of ours in them.
"""

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray import serve

from bench.path_profile import TICK, cpu_ticks, name_of, session_pids
from bench.vllm_peer import ROOT, Server, build_checkpoints, free_port, load, prompts, start_ours
from cluster.cli import ray_defaults

PATH = ("Ingress replica", "chat replica", "HAProxy")


def bare_app(args: dict):
    """The bare application: `Ingress` -> `ChatModel` (named as the service's so /proc's names match).

    args: `hold`, tokens a message; `step_s` (optional): the paced floor, where the streaming deployment yields
    only a request's first token and the Ingress writes the rest itself, `hold` tokens every `hold * step_s`
    seconds, as a token channel that cost nothing would hand them over (bench.relay --floor)."""
    hold, step_s = int(args.get("hold", 4)), args.get("step_s")
    api = FastAPI()

    @serve.deployment(max_ongoing_requests=1024)
    class ChatModel:
        async def generate(self, n: int):
            if step_s is not None:          # the paced floor: the first token, and the Ingress makes the rest
                yield "x"
                return
            for start in range(0, n, hold):
                yield "x" * min(hold, n - start)

    @serve.deployment(max_ongoing_requests=2048)
    @serve.ingress(api)
    class Ingress:
        def __init__(self, chat):
            self.chat = chat.options(stream=True)

        @api.get("/healthz")
        async def healthz(self):
            return {"ok": True}

        @api.post("/v1/completions")
        @api.post("/v1/chat/completions")
        async def completions(self, request: Request):
            body = await request.json()
            n = int(body["max_tokens"])
            stream = self.chat.generate.remote(n)
            chunk = {"id": "cmpl-0123456789abcdef", "object": "text_completion", "created": int(time.time()),
                     "model": "bare", "choices": [{"index": 0, "text": ""}]}

            def event(text: str) -> str:
                chunk["choices"][0]["text"] = text
                return "data: " + json.dumps(chunk) + "\n\n"

            async def events():
                sent = 0
                async for text in stream:
                    sent += len(text)
                    yield event(text)
                while sent < n:
                    await asyncio.sleep(hold * step_s)
                    k = min(hold, n - sent)
                    sent += k
                    yield event("x" * k)
                yield "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": n}}) + "\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

    return Ingress.bind(ChatModel.bind())


def start_bare(work: Path, hold: int, step_s: float | None = None) -> Server:
    port = free_port()
    config = work / "bare.yaml"
    config.write_text(yaml.safe_dump({
        "proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": "startlux", "route_prefix": "/", "import_path": "bench.serve_floor:bare_app",
                          "args": {"hold": hold, "step_s": step_s}}]}))
    env = {**ray_defaults(), "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
           "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()), "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port())}
    return Server([str(Path(sys.executable).parent / "serve"), "run", str(config)], env, work / "bare.log",
                  f"http://127.0.0.1:{port}", "/healthz")


def measure(server: Server, ids: list[list[int]], streams: int, requests: int, max_tokens: int) -> dict:
    before, t0 = cpu_ticks(session_pids(server.proc.pid)), time.perf_counter()
    run = asyncio.run(load(server.url, None, streams, requests // streams, max_tokens, ids))
    # listed again: Serve restarts HAProxy when the routes change, so a process may be younger than the window
    after, wall = cpu_ticks(session_pids(server.proc.pid)), time.perf_counter() - t0
    done = streams * (requests // streams)
    per = {name: 0.0 for name in PATH}
    for pid, t in after.items():
        name = name_of(pid)
        if name in per:
            per[name] += (t - before.get(pid, 0)) / TICK * 1000 / done
    return {"requests_per_s": done / wall, "tokens": run["tokens"], "ms_per_request": per}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--requests", type=int, default=640)
    p.add_argument("--max-tokens", type=int, nargs="+", default=[4, 64])
    p.add_argument("--hold", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="serve-floor-"))
    ours, _, vocab, bos = build_checkpoints(work)
    ids = prompts(args.requests, min(vocab, bos), bos)
    rows = []
    for rnd in range(args.rounds):
        for kind in ("bare Serve", "the service"):
            server = (start_bare(work, args.hold) if kind == "bare Serve" else
                      start_ours(ours, work, {"chat_stream_interval": args.hold, "chat_stream_interval_s": 0.0}))
            try:
                server.wait_ready()
                asyncio.run(load(server.url, None, 4, 2, 8, ids[:8]))          # warm both hops
                for max_tokens in args.max_tokens:
                    r = measure(server, ids, args.streams, args.requests, max_tokens)
                    rows.append({"round": rnd + 1, "app": kind, "max_tokens": max_tokens, **r})
                    ms = r["ms_per_request"]
                    print(f"round {rnd + 1}, {kind:11}, {max_tokens:4} tokens: {r['requests_per_s']:6.1f} req/s; "
                          f"CPU ms per request: " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items())
                          + f", path {sum(ms.values()):.2f}", flush=True)
            finally:
                server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
